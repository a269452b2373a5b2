// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// PodRecord is one slot of the journal ae_pod_meta in use: the pod as the
// maps describe it, and what the agent filed to undo or adopt it.
type PodRecord struct {
	EnrolledPod
	// Journal is bpfobj.MetaEnrolled, or where a stopped agent left the
	// pod (MetaEnrolling, MetaRemoving).
	Journal     uint32
	NetnsPath   string // the netns path the agent used
	SavedFwmark uint32 // the pod's own tcp_fwmark_accept
	Ifindex     uint32 // of the pod interface, in its netns
}

// ReadPods decodes the pods of the maps' journal: metadata by slot, then
// each pod's addresses from ae_pods (only entries it still owns). Pods an
// agent was enrolling or removing when it stopped are included, with
// their journal state. They are sorted by namespace and name.
func ReadPods(m *bpfobj.SockMaps) ([]*PodRecord, error) {
	bySlot := map[uint32]*PodRecord{}
	err := eachSlot(m.AePodMeta, func(slot uint32, meta *bpfobj.SockPodMeta) {
		if meta.State == bpfobj.MetaFree {
			return
		}
		bySlot[slot] = &PodRecord{EnrolledPod: EnrolledPod{
			UID: bpfobj.GoString(meta.Uid[:]), Namespace: bpfobj.GoString(meta.Namespace[:]), Name: bpfobj.GoString(meta.Name[:]),
			Interface: bpfobj.GoString(meta.Ifname[:]), HostInterface: bpfobj.GoString(meta.HostIfname[:]),
			NetnsCookie: meta.NetnsCookie, Slot: slot,
		}, Journal: meta.State, NetnsPath: bpfobj.GoString(meta.Netns[:]), SavedFwmark: meta.SavedFwmarkAccept}
	})
	if err != nil {
		return nil, fmt.Errorf("read ae_pod_meta: %w", err)
	}
	var (
		key      bpfobj.SockAeAddr
		info     bpfobj.SockPodInfo
		optioned = map[uint32]bool{} // slots an ae_pods entry gave options
	)
	pit := m.AePods.Iterate()
	for pit.Next(&key, &info) {
		if st := bySlot[info.Slot]; st != nil && st.NetnsCookie == info.NetnsCookie {
			st.IPs = append(st.IPs, netip.AddrFrom16(key.B).Unmap())
			st.Options = OptionsFromFlags(info.Flags)
			st.Ifindex = info.Ifindex
			optioned[info.Slot] = true
		}
	}
	if err := pit.Err(); err != nil {
		return nil, fmt.Errorf("read ae_pods: %w", err)
	}
	// ae_netns names each pod's first address of each family: one whose
	// ae_pods entry is missing or another pod's is still the pod's (and
	// its problem, below), not forgotten.
	var (
		cookie uint64
		ns     bpfobj.SockNetnsInfo
	)
	nit := m.AeNetns.Iterate()
	for nit.Next(&cookie, &ns) {
		st := bySlot[ns.Slot]
		if st == nil || st.NetnsCookie != cookie {
			continue
		}
		for _, a := range []struct {
			flag uint32
			addr bpfobj.SockAeAddr
		}{{bpfobj.FlagHasV4, ns.Ip4}, {bpfobj.FlagHasV6, ns.Ip6}} {
			if ip := bpfobj.Addr(a.addr); ns.Flags&a.flag != 0 && !slices.Contains(st.IPs, ip) {
				st.IPs = append(st.IPs, ip)
			}
		}
		if !optioned[ns.Slot] {
			st.Options = OptionsFromFlags(ns.Flags) // no ae_pods entry gave them
		}
	}
	if err := nit.Err(); err != nil {
		return nil, fmt.Errorf("read ae_netns: %w", err)
	}
	nameOf := func(slot uint32) string {
		if st := bySlot[slot]; st != nil {
			return st.Namespace + "/" + st.Name
		}
		return fmt.Sprintf("(slot %d, no journal entry)", slot)
	}
	out := make([]*PodRecord, 0, len(bySlot))
	for _, st := range bySlot {
		slices.SortFunc(st.IPs, func(a, b netip.Addr) int { return a.Compare(b) })
		if st.Journal == bpfobj.MetaEnrolled {
			st.Problem = Problem(m, &st.EnrolledPod, nameOf)
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b *PodRecord) int {
		if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out, nil
}

// slotBatch is how many elements of an array map eachSlot reads per
// syscall.
const slotBatch = 512

// eachSlot calls fn with every element of the array map m, in index
// order, read slotBatch at a time (BPF_MAP_LOOKUP_BATCH, which arrays
// have since Linux 5.6). An iterator takes two syscalls per element: for
// ae_pod_meta's 8192 slots, whether used or not, that was 16384 syscalls
// on every agent start and every read of the pinned maps.
func eachSlot[V any](m *ebpf.Map, fn func(slot uint32, v *V)) error {
	keys := make([]uint32, slotBatch)
	vals := make([]V, slotBatch)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			fn(keys[i], &vals[i])
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// ReadStats reads the counters of the pod in slot, summed over CPUs.
func ReadStats(m *bpfobj.SockMaps, slot uint32) (Stats, error) {
	perCPU := make([]bpfobj.SockPodStats, ebpf.MustPossibleCPU())
	if err := m.AeStats.Lookup(slot, &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read ae_stats: %w", err)
	}
	var s Stats
	for _, c := range perCPU {
		s.OutboundRedirects += c.OutboundRedirects
		s.InboundRedirects += c.InboundRedirects
		s.InboundNoListener += c.InboundNoListener
		s.OrigDstErrors += c.OrigDstErrors
		s.DNSRedirects += c.DnsRedirects
		s.RerouteRedirects += c.RerouteRedirects
		s.ProbeSNAT += c.ProbeSnat
		s.ProbeNATFull += c.ProbeNatFull
	}
	return s, nil
}

// ownsEntry reports whether ip's ae_pods entry is st's.
func ownsEntry(m *bpfobj.SockMaps, st *EnrolledPod, ip netip.Addr) bool {
	var info bpfobj.SockPodInfo
	return m.AePods.Lookup(bpfobj.AddrKey(ip), &info) == nil && info.NetnsCookie == st.NetnsCookie && info.Slot == st.Slot
}

// Problem says what of a pod's capture its map entries do not give it,
// "" when they all do: no ae_netns entry (outbound), an address without
// its ae_pods entry or with another pod's (inbound). nameOf names the pod
// of a slot.
func Problem(m *bpfobj.SockMaps, st *EnrolledPod, nameOf func(slot uint32) string) string {
	var out []string
	var ns bpfobj.SockNetnsInfo
	if err := m.AeNetns.Lookup(st.NetnsCookie, &ns); err != nil || ns.Slot != st.Slot {
		out = append(out, "no ae_netns entry: outbound traffic is not captured")
	}
	for _, ip := range st.IPs {
		var info bpfobj.SockPodInfo
		switch err := m.AePods.Lookup(bpfobj.AddrKey(ip), &info); {
		case err != nil:
			out = append(out, fmt.Sprintf("no ae_pods entry for %s: inbound traffic to it is not captured", ip))
		case info.NetnsCookie != st.NetnsCookie || info.Slot != st.Slot:
			out = append(out, fmt.Sprintf("the ae_pods entry for %s is pod %s's: inbound traffic to it is not captured", ip, nameOf(info.Slot)))
		}
	}
	return strings.Join(out, "; ")
}

// JournalName names a journal state (PodRecord.Journal).
func JournalName(state uint32) string {
	switch state {
	case bpfobj.MetaEnrolled:
		return "enrolled"
	case bpfobj.MetaEnrolling:
		return "enrolling"
	case bpfobj.MetaRemoving:
		return "removing"
	}
	return "free"
}

// AddPinnedReroutes adds to opts the virtual interfaces the pod's pin
// directory dir names (reroute_<if>): the maps do not keep them.
func AddPinnedReroutes(dir string, opts *podopts.Options) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if v, ok := bpfobj.RerouteInterface(e.Name()); ok && !slices.Contains(opts.RerouteInterfaces, v) {
			opts.RerouteInterfaces = append(opts.RerouteInterfaces, v)
		}
	}
}
