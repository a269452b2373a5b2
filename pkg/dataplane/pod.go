// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// Pod is what Enroll needs to know about a pod.
type Pod struct {
	// UID identifies the pod; it names its pins.
	UID       string
	Namespace string
	Name      string
	// Netns is a path to the pod's network namespace
	// (/proc/<pid>/ns/net, /var/run/netns/<name>, ...).
	Netns string
	// Interface is the pod-side interface inbound traffic arrives on.
	Interface string
	// HostInterface is the node side of the pod's veth; empty: found from
	// the pod interface's peer.
	HostInterface string
	// Cgroup is the pod's cgroup v2 directory, where its socket programs
	// attach with per-pod socket hooks (Config.SocketHooks); empty: found
	// by UID below Config.PodsCgroup, as kubelet names it (FindPodCgroup).
	Cgroup string
	// IPs are the pod's addresses; at most one per family is used for
	// outbound redirection, all of them for inbound.
	IPs     []netip.Addr
	Options podopts.Options
	// Running: the pod's containers run already (adopted, repaired or
	// taken over in place, not a CNI ADD), so ztunnel may be listening in
	// its netns before this enrolment: Enroll then files those listeners
	// (bpf/listeners.c) before the pod's entries too, not only after them
	// as for every pod. Each run walks the node's TCP tables.
	Running bool
}

// validate refuses a pod the data path cannot represent, or whose
// identity could reach a path: the UID names the pod's pin directory, and
// interface names name pins too. The entry points (CNI, informers, the pod
// file) validate by Kubernetes' rules; this is the data path's own guard.
func (p *Pod) validate() error {
	var meta bpfobj.SockPodMeta
	switch {
	case !ValidUID(p.UID):
		return fmt.Errorf("pod %q/%q: uid %q is not 1 to %d of [A-Za-z0-9._-] (and not . or ..)", p.Namespace, p.Name, p.UID, maxUIDLen)
	case !safeText(p.Namespace, len(meta.Namespace)-1) || !safeText(p.Name, len(meta.Name)-1):
		return fmt.Errorf("pod %q/%q: namespace or name empty, too long or not printable ASCII", p.Namespace, p.Name)
	case p.Netns == "" || !filepath.IsAbs(p.Netns) || strings.ContainsRune(p.Netns, 0) || len(p.Netns) >= len(meta.Netns):
		return fmt.Errorf("pod %s/%s: netns path %q is not an absolute path shorter than %d bytes", p.Namespace, p.Name, p.Netns, len(meta.Netns))
	case p.Cgroup != "" && (!filepath.IsAbs(p.Cgroup) || filepath.Clean(p.Cgroup) != p.Cgroup):
		return fmt.Errorf("pod %s/%s: cgroup %q is not a clean absolute path", p.Namespace, p.Name, p.Cgroup)
	case len(p.IPs) == 0:
		return fmt.Errorf("pod %s/%s: no IPs", p.Namespace, p.Name)
	case !validIfname(p.Interface):
		return fmt.Errorf("pod %s/%s: bad interface name %q", p.Namespace, p.Name, p.Interface)
	case p.HostInterface != "" && !validIfname(p.HostInterface):
		return fmt.Errorf("pod %s/%s: bad host interface name %q", p.Namespace, p.Name, p.HostInterface)
	}
	for _, v := range p.Options.RerouteInterfaces {
		if !validIfname(v) || v == p.Interface || v == "lo" {
			return fmt.Errorf("pod %s/%s: bad reroute interface %q", p.Namespace, p.Name, v)
		}
	}
	for _, ip := range p.IPs {
		if !ip.IsValid() || ip.Zone() != "" {
			return fmt.Errorf("pod %s/%s: invalid IP %v", p.Namespace, p.Name, ip)
		}
	}
	return nil
}

// maxUIDLen is what ae_pod_meta keeps of a UID (uid[64] with its NUL).
const maxUIDLen = 63

// ValidUID reports whether uid can name a pod in the data path: 1 to 63
// bytes of [A-Za-z0-9._-], not "." or "..". Kubernetes UIDs (UUIDs) are.
func ValidUID(uid string) bool {
	if uid == "" || len(uid) > maxUIDLen || uid == "." || uid == ".." {
		return false
	}
	for i := 0; i < len(uid); i++ {
		c := uid[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// validIfname follows the kernel's rules for interface names (dev_valid_name).
func validIfname(name string) bool {
	if name == "" || len(name) > 15 || name == "." || name == ".." {
		return false
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c == '/' || c == ':' || c <= ' ' || c >= 0x7f {
			return false
		}
	}
	return true
}

// safeText is non-empty printable ASCII of at most max bytes.
func safeText(s string, max int) bool {
	if s == "" || len(s) > max {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return true
}

func (p *Pod) normalize() {
	if p.Interface == "" {
		p.Interface = bpfobj.DefaultInterface
	}
	for i, ip := range p.IPs {
		p.IPs[i] = ip.Unmap()
	}
	slices.SortFunc(p.IPs, func(a, b netip.Addr) int { return a.Compare(b) })
	p.IPs = slices.Compact(p.IPs)
}

// netnsInfo builds the ae_netns value: the first address of each family.
func (p *Pod) netnsInfo(slot uint32) bpfobj.SockNetnsInfo {
	info := bpfobj.SockNetnsInfo{Slot: slot, Flags: inspect.OptionFlags(p.Options)}
	for _, ip := range p.IPs {
		switch {
		case ip.Is4() && info.Flags&bpfobj.FlagHasV4 == 0:
			info.Ip4.B = ip.As16()
			info.Flags |= bpfobj.FlagHasV4
		case ip.Is6() && info.Flags&bpfobj.FlagHasV6 == 0:
			info.Ip6.B = ip.As16()
			info.Flags |= bpfobj.FlagHasV6
		}
	}
	return info
}

func (p *Pod) hasV6() bool {
	for _, ip := range p.IPs {
		if ip.Is6() {
			return true
		}
	}
	return false
}
