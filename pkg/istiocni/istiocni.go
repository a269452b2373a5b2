// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package istiocni recognises and removes istio-cni's redirection state:
// in a pod its iptables chains (either backend, both families) or its
// native nftables tables, its return-path policy rule and local routes;
// on the node its host-probe SNAT chain and probe ipsets. It is the
// takeover's library: the caller enrols the pod in eBPF first, then
// removes istio-cni's state, and only when Inspect said it is exactly
// what istio-cni writes.
//
// iptables state is read and written by the iptables-save and
// iptables-restore binaries of each backend, run on an OS thread switched
// into the netns: the legacy backend's rule blobs and iptables-nft's
// nftables encoding (xt compat expressions with its own userdata) are
// only read back correctly by those binaries, so a Go encoder could write
// rules iptables can no longer list or delete. What istio-cni would write
// is compared in the form those same binaries print: the expected rules
// are applied and saved in a scratch netns first.
//
// Removing istio-cni's rules alone resets every connection they
// redirected: conntrack and NAT hooks are registered in a netns only while
// something uses them (nf_ct_netns_get), and in a pod istio-cni's rules
// are those users. So the takeover of a pod is: enrol it in eBPF;
// InstallDrain, which adds table inet ambient-ebpf-drain (our own no-op
// rules that hold conntrack and NAT, and keep istio-cni's return mark on
// its inbound deliveries); RemovePod with KeepReturnPath; and RemoveDrain
// once RedirectedFlows is 0. The drain speaks netlink (google/nftables,
// ctnetlink), not the nft binary. See DrainTable.
package istiocni

import (
	"os/exec"
	"sync"
)

// Backend is where istio-cni's rules live.
type Backend string

const (
	Legacy    Backend = "iptables-legacy" // iptables-legacy(-save/-restore)
	NftCompat Backend = "iptables-nft"    // iptables-nft: the iptables tables in nftables
	Nftables  Backend = "nftables"        // istio-cni's native nftables mode (Istio 1.28+)
)

// tools are one backend's binaries for one family.
type tools struct {
	backend       Backend
	family        Family
	save, restore string
}

// RuleManager reads, removes and writes istio-cni's state with the
// installed binaries: a pod's in-pod rules (InspectPod, RemovePod,
// ApplyPod) and the node's probe rule and ipsets (InspectNode, RemoveNode,
// ApplyNode, AddProbeEntries, RemoveProbeEntries). It caches the expected
// rule sets by options, so inspecting many pods applies each once.
type RuleManager struct {
	iptables []tools // the backends and families whose binaries are installed
	missing  []string
	nft      string // the nft binary, "" when not installed

	mu    sync.Mutex
	canon map[string]string
}

// New finds the installed binaries: iptables-legacy-save/-restore,
// iptables-nft-save/-restore (and ip6tables-*), nft. A backend whose
// binaries are missing is not looked at (Missing names them).
func New() *RuleManager {
	mgr := &RuleManager{canon: map[string]string{}}
	for _, b := range []struct {
		backend Backend
		suffix  string
	}{{Legacy, "-legacy"}, {NftCompat, "-nft"}} {
		for _, f := range []Family{IPv4, IPv6} {
			t := tools{backend: b.backend, family: f, save: f.tool + b.suffix + "-save", restore: f.tool + b.suffix + "-restore"}
			save, err1 := exec.LookPath(t.save)
			restore, err2 := exec.LookPath(t.restore)
			if err1 != nil || err2 != nil {
				mgr.missing = append(mgr.missing, t.save)
				continue
			}
			t.save, t.restore = save, restore
			mgr.iptables = append(mgr.iptables, t)
		}
	}
	if p, err := exec.LookPath("nft"); err == nil {
		mgr.nft = p
	} else {
		mgr.missing = append(mgr.missing, "nft")
	}
	return mgr
}

// Missing names the binaries not found: state of those backends is
// neither seen nor removed.
func (mgr *RuleManager) Missing() []string { return mgr.missing }
