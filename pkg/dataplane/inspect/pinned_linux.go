// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// ErrNotInstalled is returned when no data path is pinned at a directory.
var ErrNotInstalled = bpfobj.ErrNotInstalled

// Pinned is a read-only view of a node's pinned maps. It works without the
// agent: the CLI's pods, maps and stats commands read it.
type Pinned struct {
	dir  string // dataplane.Config.BPFFSDir
	maps bpfobj.SockMaps
}

// OpenPinned opens the maps pinned under bpffsDir (dataplane.Config.BPFFSDir).
func OpenPinned(bpffsDir string) (*Pinned, error) {
	dir := filepath.Join(bpffsDir, "maps")
	if _, err := os.Stat(filepath.Join(dir, bpfobj.SockMapAeNetns)); errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w", bpffsDir, ErrNotInstalled)
	}
	spec, err := bpfobj.LoadSock()
	if err != nil {
		return nil, err
	}
	p := &Pinned{dir: bpffsDir}
	opts := &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: dir, LoadPinOptions: ebpf.LoadPinOptions{ReadOnly: true}}}
	if err := spec.LoadAndAssign(&p.maps, opts); err != nil {
		return nil, fmt.Errorf("open pinned maps in %s: %w", dir, err)
	}
	return p, nil
}

// Close releases the map handles.
func (p *Pinned) Close() error { return p.maps.Close() }

// Pods returns the enrolled pods.
func (p *Pinned) Pods() ([]EnrolledPod, error) {
	states, err := ReadPods(&p.maps)
	if err != nil {
		return nil, err
	}
	out := make([]EnrolledPod, 0, len(states))
	for _, st := range states {
		if st.Journal == bpfobj.MetaEnrolled {
			out = append(out, st.EnrolledPod)
		}
	}
	return out, nil
}

// Stats returns a pod's counters by slot (EnrolledPod.Slot).
func (p *Pinned) Stats(slot uint32) (Stats, error) { return ReadStats(&p.maps, slot) }

// MapDump is every pinned map decoded, for people (the CLI's maps command).
type MapDump struct {
	Pods     []PodEntry      `json:"ae_pods"`
	Netns    []NetnsEntry    `json:"ae_netns"`
	Meta     []MetaEntry     `json:"ae_pod_meta"`
	Stats    []StatsEntry    `json:"ae_stats"`
	OrigDst  []OrigDstEntry  `json:"ae_orig_dst"`
	ProbeNAT []ProbeNATEntry `json:"ae_probe_nat"`
}

// PodEntry is one ae_pods entry.
type PodEntry struct {
	IP          netip.Addr      `json:"ip"`
	Pod         string          `json:"pod"` // namespace/name from ae_pod_meta
	NetnsCookie uint64          `json:"netnsCookie"`
	Slot        uint32          `json:"slot"`
	Options     podopts.Options `json:"options"`
}

// NetnsEntry is one ae_netns entry.
type NetnsEntry struct {
	NetnsCookie uint64          `json:"netnsCookie"`
	Pod         string          `json:"pod"`
	IPv4        netip.Addr      `json:"ipv4,omitzero"`
	IPv6        netip.Addr      `json:"ipv6,omitzero"`
	Slot        uint32          `json:"slot"`
	Options     podopts.Options `json:"options"`
}

// MetaEntry is one slot of ae_pod_meta in use.
type MetaEntry struct {
	Slot          uint32 `json:"slot"`
	UID           string `json:"uid"`
	Pod           string `json:"pod"`
	Interface     string `json:"interface"`
	HostInterface string `json:"hostInterface"`
	NetnsCookie   uint64 `json:"netnsCookie"`
	Netns         string `json:"netns"` // the path the agent used
	// State is the journal's: enrolled, or enrolling / removing when an
	// agent stopped part way (the next one undoes it).
	State string `json:"state"`
}

// StatsEntry is one pod's counters from ae_stats, summed over CPUs.
type StatsEntry struct {
	Slot  uint32 `json:"slot"`
	Pod   string `json:"pod"`
	Stats Stats  `json:"stats"`
}

// OrigDstEntry is one original destination filed for ztunnel.
type OrigDstEntry struct {
	NetnsCookie uint64         `json:"netnsCookie"`
	Client      netip.AddrPort `json:"client"`
	OrigDst     netip.AddrPort `json:"origDst"`
}

// ProbeNATEntry is one live host-probe translation.
type ProbeNATEntry struct {
	Pod      netip.AddrPort `json:"pod"`
	HostPort uint16         `json:"hostPort"`
	Host     netip.Addr     `json:"host"`
}

// Dump decodes every map except ae_sk_dst, which is socket storage and
// cannot be listed from user space.
func (p *Pinned) Dump() (*MapDump, error) {
	pods, err := ReadPods(&p.maps)
	if err != nil {
		return nil, err
	}
	names := map[uint32]string{}
	d := &MapDump{}
	for _, st := range pods {
		name := st.Namespace + "/" + st.Name
		names[st.Slot] = name
		d.Meta = append(d.Meta, MetaEntry{Slot: st.Slot, UID: st.UID, Pod: name, Interface: st.Interface,
			HostInterface: st.HostInterface, NetnsCookie: st.NetnsCookie, Netns: st.NetnsPath, State: JournalName(st.Journal)})
		s, err := ReadStats(&p.maps, st.Slot)
		if err != nil {
			return nil, err
		}
		d.Stats = append(d.Stats, StatsEntry{Slot: st.Slot, Pod: name, Stats: s})
	}
	var (
		addr bpfobj.SockAeAddr
		info bpfobj.SockPodInfo
	)
	it := p.maps.AePods.Iterate()
	for it.Next(&addr, &info) {
		d.Pods = append(d.Pods, PodEntry{IP: bpfobj.Addr(addr), Pod: names[info.Slot], NetnsCookie: info.NetnsCookie, Slot: info.Slot, Options: OptionsFromFlags(info.Flags)})
	}
	var (
		cookie uint64
		ns     bpfobj.SockNetnsInfo
	)
	nit := p.maps.AeNetns.Iterate()
	for nit.Next(&cookie, &ns) {
		e := NetnsEntry{NetnsCookie: cookie, Pod: names[ns.Slot], Slot: ns.Slot, Options: OptionsFromFlags(ns.Flags)}
		if ns.Flags&bpfobj.FlagHasV4 != 0 {
			e.IPv4 = bpfobj.Addr(ns.Ip4)
		}
		if ns.Flags&bpfobj.FlagHasV6 != 0 {
			e.IPv6 = bpfobj.Addr(ns.Ip6)
		}
		d.Netns = append(d.Netns, e)
	}
	var (
		ok bpfobj.SockOrigKey
		od bpfobj.SockOrigDst
	)
	oit := p.maps.AeOrigDst.Iterate()
	for oit.Next(&ok, &od) {
		d.OrigDst = append(d.OrigDst, OrigDstEntry{NetnsCookie: ok.NetnsCookie,
			Client:  netip.AddrPortFrom(bpfobj.Addr(ok.Addr), bpfobj.Ntohs(ok.Port)),
			OrigDst: netip.AddrPortFrom(bpfobj.Addr(od.Addr), bpfobj.Ntohs(od.Port))})
	}
	var (
		pk bpfobj.SockProbeKey
		pn bpfobj.SockProbeNat
	)
	pit := p.maps.AeProbeNat.Iterate()
	for pit.Next(&pk, &pn) {
		d.ProbeNAT = append(d.ProbeNAT, ProbeNATEntry{Pod: netip.AddrPortFrom(bpfobj.Addr(pk.Pod), bpfobj.Ntohs(pk.PodPort)),
			HostPort: bpfobj.Ntohs(pk.HostPort), Host: bpfobj.Addr(pn.Host)})
	}
	for _, err := range []error{it.Err(), nit.Err(), oit.Err(), pit.Err()} {
		if err != nil {
			return nil, fmt.Errorf("read maps: %w", err)
		}
	}
	return d, nil
}
