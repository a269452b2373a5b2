// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// Policy routing of the return path (R10, R14), as istio-cni sets it up:
// packets with the return mark are delivered locally, over lo.
const (
	returnMark      = 0x111
	returnTable     = 100
	returnRulePrio  = 32764
	fwmarkAcceptKey = "sys/net/ipv4/tcp_fwmark_accept" // under Config.ProcRoot
)

// attachment is one TC program of a pod, pinned as pods/<uid>/<pin>.
type attachment struct {
	pin    string
	netns  string // path of the netns the interface is in
	iface  string
	attach ebpf.AttachType
	prog   *ebpf.Program
	// classid of a tc filter: the pod's slot + 1, which the program
	// reads as skb->tc_classid to name its pod in trace events.
	classid uint32
	// cgroup of a socket program (bpfobj.CgroupHooks): the pod's cgroup
	// directory; "" where only its pin is known (an adopted pod).
	cgroup string
}

func (a attachment) String() string {
	if bpfobj.IsCgroupPin(a.pin) {
		return fmt.Sprintf("%s on cgroup %s", strings.TrimPrefix(a.pin, bpfobj.CgroupPrefix), a.cgroup)
	}
	switch a.attach {
	case ebpf.AttachSkLookup:
		return "sk_lookup in " + a.netns
	case ebpf.AttachTCXEgress:
		return "tc egress on " + a.iface
	}
	return "tc ingress on " + a.iface
}

// plan lists the programs a pod in a slot needs. In the direct host-probe
// mode nothing goes on the node side of its veth (hostIf).
func (d *Dataplane) plan(p *Pod, hostIf string, slot uint32) []attachment {
	if d.cfg.HostProbes == bpfobj.ProbeDirect {
		hostIf = ""
	}
	atts := planPod(p, hostIf, d.cfg.NodeNetns, slot, !d.skLookupInbound, podPrograms{
		ingress: d.tc.AePodIngress, lo: d.tc.AePodLoIngress, reroute: d.tc.AePodReroute,
		steer: d.tc.AePodSteer, hostEgress: d.tc.AeHostEgress, hostIngress: d.tc.AeHostIngress,
	})
	if d.cfg.SocketHooks == SocketHooksPods {
		atts = append(atts, d.cgroupPlan(p.Cgroup)...)
	}
	return atts
}

// cgroupPlan lists the socket programs of a cgroup in the per-pod mode.
func (d *Dataplane) cgroupPlan(cgroup string) []attachment {
	var atts []attachment
	for _, h := range bpfobj.CgroupHooks() {
		atts = append(atts, attachment{pin: h.Name, attach: h.Attach, prog: h.Program(&d.sock.SockPrograms), cgroup: cgroup})
	}
	return atts
}

// podPrograms are the per-pod programs.
type podPrograms struct {
	ingress, lo, reroute, steer, hostEgress, hostIngress *ebpf.Program
}

// of is the program of the pod pin (bpfobj.PodHooks).
func (p podPrograms) of(pin string) *ebpf.Program {
	if _, ok := bpfobj.RerouteInterface(pin); ok {
		return p.reroute
	}
	switch pin {
	case "ingress":
		return p.ingress
	case "lo_ingress":
		return p.lo
	case "sk_lookup":
		return p.steer
	case "host_egress":
		return p.hostEgress
	case "host_ingress":
		return p.hostIngress
	}
	return nil
}

// planPod lists where the programs of the pod in slot go
// (bpfobj.PodHooks), each with its program.
func planPod(p *Pod, hostIf, nodeNetns string, slot uint32, tcIngress bool, progs podPrograms) []attachment {
	var atts []attachment
	for _, h := range bpfobj.PodHooks(p.Netns, p.Interface, p.Options.RerouteInterfaces, hostIf, nodeNetns, slot, tcIngress) {
		atts = append(atts, attachment{pin: h.Pin, netns: h.Netns, iface: h.Iface, attach: h.Attach, prog: progs.of(h.Pin), classid: h.Classid})
	}
	return atts
}

// attach attaches and pins one program; see tcHooks for how.
func (d *Dataplane) attach(uid string, a attachment) (tcProgram, error) {
	dir := podDir(d.cfg, uid)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create pod pin directory: %w", err)
	}
	return d.hooksFor(a).attach(a, filepath.Join(dir, a.pin))
}

// hooksFor picks how a is attached: sk_lookup by a netns link, TC
// programs as chosen in New.
func (d *Dataplane) hooksFor(a attachment) tcHooks {
	if a.attach == ebpf.AttachSkLookup {
		return netnsHooks{}
	}
	if bpfobj.IsCgroupPin(a.pin) {
		return cgroupHooks{}
	}
	return d.hooks
}

// podNetnsState is what Enroll reads in the pod netns before it changes
// anything there.
type podNetnsState struct {
	cookie       uint64
	podIndex     int // ifindex of the pod interface
	peerIndex    int // ifindex of its veth peer, in the peer's netns
	fwmarkAccept uint32
}

// probePodNetns reads the pod's netns cookie, its interface and veth
// peer, and tcp_fwmark_accept as the pod has it. It changes nothing.
func (d *Dataplane) probePodNetns(p *Pod) (podNetnsState, error) {
	var st podNetnsState
	if err := d.refuseNodeNetns(p.Netns); err != nil {
		return st, fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	err := nsexec.Do(p.Netns, func() error {
		var err error
		if st.cookie, err = d.netnsCookie(); err != nil {
			return err
		}
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		l, err := h.LinkByName(p.Interface)
		if err != nil {
			return fmt.Errorf("find interface %s: %w", p.Interface, err)
		}
		st.podIndex, st.peerIndex = l.Attrs().Index, l.Attrs().ParentIndex
		prev, err := os.ReadFile(filepath.Join(d.cfg.ProcRoot, fwmarkAcceptKey))
		if err != nil {
			return fmt.Errorf("read tcp_fwmark_accept: %w", err)
		}
		if len(prev) > 0 && prev[0] == '1' {
			st.fwmarkAccept = 1
		}
		return nil
	})
	if err != nil {
		return st, fmt.Errorf("pod %s/%s: netns %s: %w", p.Namespace, p.Name, p.Netns, err)
	}
	return st, nil
}

// setupReturnPath installs the return path (R10) in the pod netns: the
// policy rule and route, and tcp_fwmark_accept. It is idempotent.
func (d *Dataplane) setupReturnPath(p *Pod) error {
	return nsexec.Do(p.Netns, func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		if err := addReturnPath(h, p.hasV6()); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(d.cfg.ProcRoot, fwmarkAcceptKey), []byte("1"), 0o644); err != nil {
			return fmt.Errorf("set tcp_fwmark_accept: %w", err)
		}
		return nil
	})
}

func returnRule(family int) *netlink.Rule {
	r := netlink.NewRule()
	r.Family = family
	r.Mark = returnMark
	mask := uint32(bpfobj.DefaultMarkMask)
	r.Mask = &mask
	r.Priority = returnRulePrio
	r.Table = returnTable
	return r
}

func returnRoute(family int) *netlink.Route {
	dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
	if family == unix.AF_INET6 {
		dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &netlink.Route{Family: family, Dst: dst, Table: returnTable, Type: unix.RTN_LOCAL, Scope: unix.RT_SCOPE_HOST}
}

func addReturnPath(h *netlink.Handle, hasV6 bool) error {
	families := []int{unix.AF_INET}
	if hasV6 {
		families = append(families, unix.AF_INET6)
	}
	lo, err := h.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	for _, fam := range families {
		if err := h.RuleAdd(returnRule(fam)); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add return-path rule (family %d): %w", fam, err)
		}
		rt := returnRoute(fam)
		rt.LinkIndex = lo.Attrs().Index
		if err := h.RouteReplace(rt); err != nil {
			return fmt.Errorf("add return-path route (family %d): %w", fam, err)
		}
	}
	return nil
}

// teardownPodNetns undoes setupPodNetns (keepReturnPath: but for the
// return-path rule and routes, which someone else's rules use now). A pod whose netns is gone needs
// nothing undone.
func teardownPodNetns(procRoot, path string, savedFwmarkAccept uint32, keepReturnPath bool) error {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return nsexec.Do(path, func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		var errs []error
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			if keepReturnPath {
				break
			}
			if err := h.RuleDel(returnRule(fam)); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("delete return-path rule: %w", err))
			}
			rt := returnRoute(fam)
			if err := h.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("delete return-path route: %w", err))
			}
		}
		val := []byte("0")
		if savedFwmarkAccept == 1 {
			val = []byte("1")
		}
		if err := os.WriteFile(filepath.Join(procRoot, fwmarkAcceptKey), val, 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore tcp_fwmark_accept: %w", err))
		}
		return errors.Join(errs...)
	})
}

// nodeNetlink returns the netlink handle in the node netns, opened by the
// first call and kept until Close: one per enrolment (the netns opened, a
// thread switched into it for the socket) was 4% of the agent's CPU per
// enrolment at 1000 pods. Callers hold d.mu.
func (d *Dataplane) nodeNetlink() (*netlink.Handle, error) {
	if d.nodeNL != nil {
		return d.nodeNL, nil
	}
	ns, err := netns.GetFromPath(d.cfg.NodeNetns)
	if err != nil {
		return nil, fmt.Errorf("open node netns %s: %w", d.cfg.NodeNetns, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink in node netns %s: %w", d.cfg.NodeNetns, err)
	}
	d.nodeNL = h
	return h, nil
}

// hostInterface finds the node side of the pod's veth: the interface in
// the node netns whose index the pod interface names as its peer, and
// whose own peer is that pod interface.
func (d *Dataplane) hostInterface(p *Pod, podIndex, peerIndex int) (string, error) {
	if p.HostInterface != "" {
		return p.HostInterface, nil
	}
	if peerIndex == 0 {
		return "", fmt.Errorf("pod %s/%s: interface %s has no veth peer; set the host interface explicitly", p.Namespace, p.Name, p.Interface)
	}
	h, err := d.nodeNetlink()
	if err != nil {
		return "", err
	}
	l, err := h.LinkByIndex(peerIndex)
	if err != nil {
		return "", fmt.Errorf("pod %s/%s: find the node side of %s (ifindex %d): %w", p.Namespace, p.Name, p.Interface, peerIndex, err)
	}
	if _, ok := l.(*netlink.Veth); !ok || l.Attrs().ParentIndex != podIndex {
		return "", fmt.Errorf("pod %s/%s: node interface %s is a %s, not the veth peer of %s", p.Namespace, p.Name, l.Attrs().Name, l.Type(), p.Interface)
	}
	return l.Attrs().Name, nil
}
