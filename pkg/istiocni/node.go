// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// HostRules is istio-cni's host-probe rule in one backend and family.
type HostRules struct {
	Backend Backend
	Family  string
	Jumps   []string // "nat: -A POSTROUTING -j ISTIO_POSTRT", wherever it sits
	Exact   bool     // the chain is exactly istio-cni's SNAT rule
	Diff    string
}

// Node is istio-cni's state in the node netns.
type Node struct {
	Netns    string
	Iptables []HostRules
	// IPSets: the probe ipsets present, with their entry counts.
	IPSets map[string]int
	// NftTable: istio-cni's native nftables host table (inet
	// istio-ambient-nat, its postrouting chain and probe sets) is there;
	// NftSets counts the entries of those sets.
	NftTable bool
	NftSets  map[string]int
	// Binaries not found: those backends were not looked at.
	Unchecked []string
}

// Found says whether any of istio-cni's host state is there.
func (n *Node) Found() bool { return len(n.Iptables) > 0 || len(n.IPSets) > 0 || n.NftTable }

// Entries is the number of pod IPs istio-cni's probe sets still hold:
// pods whose host probes its SNAT rule still translates.
func (n *Node) Entries() int {
	total := 0
	for _, c := range n.IPSets {
		total += c
	}
	for _, c := range n.NftSets {
		total += c
	}
	return total
}

var hostChains = []string{ChainHostPostrouting}

// InspectNode reads istio-cni's host state in the node netns at path.
func (mgr *RuleManager) InspectNode(ctx context.Context, path string) (*Node, error) {
	n := &Node{Netns: path, IPSets: map[string]int{}, NftSets: map[string]int{}, Unchecked: mgr.missing}
	saves := map[tools]string{}
	err := inNetns(path, func() error {
		for _, t := range mgr.iptables {
			out, err := run(ctx, path, "", t.save, "-t", "nat")
			if err != nil {
				return err
			}
			saves[t] = out
		}
		if err := n.readIPSets(); err != nil {
			return err
		}
		if mgr.nft == "" {
			return nil
		}
		have, err := mgr.nftTables(ctx, path, []string{NftNatTable})
		if err != nil || len(have) == 0 {
			return err
		}
		n.NftTable = true
		for _, set := range []string{ProbeSetV4, ProbeSetV6} {
			c, err := mgr.nftSetEntries(ctx, path, set)
			if err != nil {
				return err
			}
			if c >= 0 {
				n.NftSets[set] = c
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, t := range mgr.iptables {
		s, err := ParseSave(saves[t])
		if err != nil {
			return nil, fmt.Errorf("netns %s: parse %s output: %w", path, t.save, err)
		}
		r, ok := istioPart(s, hostChains)
		if !ok {
			continue
		}
		want, err := mgr.canonicalIptables(ctx, t, RenderHost(t.family), createProbeSets)
		if err != nil {
			return nil, err
		}
		ws, err := ParseSave(want)
		if err != nil {
			return nil, err
		}
		w, _ := istioPart(ws, hostChains)
		hr := HostRules{Backend: t.backend, Family: t.family.Name, Jumps: r.jumps, Diff: firstDiff(r.lines, w.lines)}
		hr.Exact = hr.Diff == ""
		n.Iptables = append(n.Iptables, hr)
	}
	return n, nil
}

func (n *Node) readIPSets() error {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netns %s: netlink: %w", n.Netns, err)
	}
	defer h.Close()
	for _, set := range []string{ProbeSetV4, ProbeSetV6} {
		res, err := h.IpsetList(set)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return fmt.Errorf("netns %s: ipset list %s: %w", n.Netns, set, err)
		}
		n.IPSets[set] = len(res.Entries)
	}
	return nil
}

// nftSetEntries counts a set's elements in istio-cni's host table; -1
// when the set does not exist.
func (mgr *RuleManager) nftSetEntries(ctx context.Context, where, set string) (int, error) {
	out, err := run(ctx, where, "", mgr.nft, "-j", "list", "sets", "inet")
	if err != nil {
		return 0, err
	}
	var doc struct {
		Nftables []struct {
			Set *struct {
				Table string            `json:"table"`
				Name  string            `json:"name"`
				Elem  []json.RawMessage `json:"elem"`
			} `json:"set"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		return 0, fmt.Errorf("netns %s: nft -j list sets: %w", where, err)
	}
	for _, o := range doc.Nftables {
		if o.Set != nil && o.Set.Table == NftNatTable && o.Set.Name == set {
			// Listing all sets leaves elements out; list this one.
			return mgr.nftSetLen(ctx, where, set)
		}
	}
	return -1, nil
}

func (mgr *RuleManager) nftSetLen(ctx context.Context, where, set string) (int, error) {
	out, err := run(ctx, where, "", mgr.nft, "-j", "list", "set", "inet", NftNatTable, set)
	if err != nil {
		return 0, err
	}
	var doc struct {
		Nftables []struct {
			Set *struct {
				Elem []json.RawMessage `json:"elem"`
			} `json:"set"`
		} `json:"nftables"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		return 0, fmt.Errorf("netns %s: nft -j list set %s: %w", where, set, err)
	}
	for _, o := range doc.Nftables {
		if o.Set != nil {
			return len(o.Set.Elem), nil
		}
	}
	return 0, nil
}

// RemoveNode takes istio-cni's host state out of the node netns at path:
// in each iptables backend and family the jumps into ISTIO_POSTRT (from
// POSTROUTING or wherever they are) and the chain; then the probe ipsets;
// its native nftables host table (with its sets). Call it once no pod is
// left on istio-cni's rules (Node.Entries, or the caller's own count):
// the SNAT rule is what keeps kubelet's probes to those pods out of their
// ztunnel. Idempotent.
func (mgr *RuleManager) RemoveNode(ctx context.Context, path string) error {
	return inNetns(path, func() error {
		var errs []error
		for _, t := range mgr.iptables {
			errs = append(errs, removeChains(ctx, path, t, hostChains))
		}
		if err := errors.Join(errs...); err != nil {
			return err // an ipset a rule still names cannot go
		}
		errs = append(errs, destroyIPSets(ctx, path, []string{ProbeSetV4, ProbeSetV6}))
		if mgr.nft != "" {
			errs = append(errs, mgr.deleteNftTables(ctx, path, []string{NftNatTable}))
		}
		return errors.Join(errs...)
	})
}

// RemoveProbeEntries takes a pod's IPs out of istio-cni's probe ipsets,
// each only while its entry still names the pod (comment = uid), as
// istio-cni does: once the pod is on eBPF its probes need no iptables SNAT.
func (mgr *RuleManager) RemoveProbeEntries(ctx context.Context, path, uid string, ips []netip.Addr) error {
	return eachProbeSet(path, ips, func(h *netlink.Handle, set string, ip netip.Addr) error {
		res, err := h.IpsetList(set)
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("netns %s: ipset list %s: %w", path, set, err)
		}
		var errs []error
		for _, e := range res.Entries {
			if a, ok := netip.AddrFromSlice(e.IP); ok && a.Unmap() == ip && e.Comment == uid {
				if err := h.IpsetDel(set, &netlink.IPSetEntry{IP: e.IP}); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("netns %s: ipset del %s %s: %w", path, set, ip, err))
				}
			}
		}
		return errors.Join(errs...)
	})
}

// eachProbeSet calls fn in the node netns at path for each IP (unmapped)
// with the probe ipset of its family.
func eachProbeSet(path string, ips []netip.Addr, fn func(h *netlink.Handle, set string, ip netip.Addr) error) error {
	return inNetns(path, func() error {
		h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
		if err != nil {
			return fmt.Errorf("netns %s: netlink: %w", path, err)
		}
		defer h.Close()
		var errs []error
		for _, ip := range ips {
			ip = ip.Unmap()
			set := ProbeSetV4
			if ip.Is6() {
				set = ProbeSetV6
			}
			errs = append(errs, fn(h, set, ip))
		}
		return errors.Join(errs...)
	})
}

// createProbeSets creates istio-cni's probe ipsets in the thread's
// netns (the scratch one: its host rule names them).
func createProbeSets() error {
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink: %w", err)
	}
	defer h.Close()
	for set, fam := range map[string]uint8{ProbeSetV4: unix.AF_INET, ProbeSetV6: unix.AF_INET6} {
		if err := h.IpsetCreate(set, "hash:ip", netlink.IpsetCreateOptions{Family: fam, Comments: true, Replace: true}); err != nil {
			return fmt.Errorf("ipset create %s: %w", set, err)
		}
	}
	return nil
}
