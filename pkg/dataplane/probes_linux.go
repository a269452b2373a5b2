// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// Host probes in the direct mode, where the kernel takes fentry programs
// (bpfobj.CfgProbeConnect): bpf/probe.c files the node's probes at
// tcp_connect(), linked as links/probe_connect, and nothing is attached to
// the node's cgroup root for them. Elsewhere the node-wide half of the
// socket programs does it (connect and sockops on the root).

// probesAtConnect reports whether this agent files the direct mode's host
// probes with bpf/probe.c.
func (d *Dataplane) probesAtConnect() bool { return d.bpfFlags&bpfobj.CfgProbeConnect != 0 }

// probeProgramLoads loads bpf/probe.c on maps of its own, unpinned, and
// closes it: whether this kernel's verifier and BTF take the program
// itself, beyond the trivial one of the feature probe. Where they do not,
// the node-wide half files host probes instead of the agent failing.
func probeProgramLoads(kernelBTF *btf.Cache) error {
	spec, err := bpfobj.LoadProbe()
	if err != nil {
		return fmt.Errorf("read the host-probe program: %w", err)
	}
	for _, m := range spec.Maps {
		m.Pinning = ebpf.PinNone
	}
	var progs bpfobj.ProbePrograms // and the maps it uses, nothing more
	if err := spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{Cache: kernelBTF}); err != nil {
		return fmt.Errorf("load the host-probe program: %w", err)
	}
	return progs.Close()
}

// loadProbeConnect loads bpf/probe.c on the socket programs' maps.
func (d *Dataplane) loadProbeConnect() error {
	if !d.probesAtConnect() {
		return nil
	}
	spec, err := bpfobj.LoadProbe()
	if err != nil {
		return fmt.Errorf("read the host-probe program: %w", err)
	}
	var vars bpfobj.ProbeSpecs
	if err := spec.Assign(&vars); err != nil {
		return fmt.Errorf("read the host-probe program: %w", err)
	}
	if err := vars.AeCfg.Set(d.loadConfig()); err != nil {
		return fmt.Errorf("configure the host-probe program: %w", err)
	}
	ino, err := netnsInode(d.cfg.NodeNetns)
	if err != nil {
		return err
	}
	if err := vars.AeNodeNetnsIno.Set(ino); err != nil {
		return fmt.Errorf("configure the host-probe program: %w", err)
	}
	m := &d.sock.SockMaps
	var progs bpfobj.ProbePrograms
	err = spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{MapReplacements: map[string]*ebpf.Map{
		"ae_probe_nat": m.AeProbeNat, "ae_node_cfg": m.AeNodeCfg, "ae_pods": m.AePods, "ae_stats": m.AeStats, "ae_decisions": m.AeDecisions,
	}, Cache: d.kernelBTF})
	if err != nil {
		d.logVerifier(err)
		return fmt.Errorf("load the host-probe program: %w", err)
	}
	d.probeConnect = progs.AeProbeConnect
	return nil
}

// netnsInode is the inode number of the netns at path: what the kernel
// calls the netns's ns.inum.
func netnsInode(path string) (uint32, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, fmt.Errorf("node netns: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, fmt.Errorf("node netns %s: no inode number", path)
	}
	return uint32(st.Ino), nil
}

// attachProbeConnect attaches bpf/probe.c to tcp_connect() and makes it the
// pinned link, replacing an earlier agent's: the new link is attached and
// pinned beside the old one first, then takes its pin in one rename, which
// leaves no moment without a program filing probes. Before the node-wide
// half goes (attachNodeHooks), for the same reason.
func (d *Dataplane) attachProbeConnect() error {
	if d.probeConnect == nil {
		return nil
	}
	pin := filepath.Join(linksDir(d.cfg), bpfobj.ProbeConnectPin)
	next := filepath.Join(linksDir(d.cfg), "moving_"+bpfobj.ProbeConnectPin) // as stageHooks names its own
	l, err := link.AttachTracing(link.TracingOptions{Program: d.probeConnect})
	if err != nil {
		return fmt.Errorf("attach the host-probe program to tcp_connect: %w", err)
	}
	_ = os.Remove(next) // a stopped agent's
	if err := l.Pin(next); err != nil {
		l.Close()
		return fmt.Errorf("pin the host-probe link: %w", err)
	}
	old, oldErr := link.LoadPinnedLink(pin, nil)
	if err := os.Rename(next, pin); err != nil {
		_ = l.Unpin()
		l.Close()
		if oldErr == nil {
			old.Close()
		}
		return fmt.Errorf("move the host-probe link to %s: %w", pin, err)
	}
	l.Close()
	if oldErr == nil {
		_ = old.Detach() // BPF_LINK_DETACH: gone even if someone holds it
		old.Close()
	}
	// Held by its pin's name from here (the one above names next).
	l, err = link.LoadPinnedLink(pin, nil)
	if err != nil {
		return fmt.Errorf("load the host-probe link: %w", err)
	}
	d.nodeLinks = append(d.nodeLinks, l)
	return nil
}

// removeProbeConnect removes an earlier agent's host-probe link where this
// one does not file probes at connect (snat mode, or no fentry): after the
// node-wide half is attached (attachNodeHooks).
func (d *Dataplane) removeProbeConnect() error {
	if d.probeConnect != nil {
		return nil
	}
	pin := filepath.Join(linksDir(d.cfg), bpfobj.ProbeConnectPin)
	if _, err := os.Stat(pin); err != nil {
		return nil
	}
	d.log.Info("removing the host-probe link: this agent files host probes with the socket programs", "link", bpfobj.ProbeConnectPin)
	return pinnedLink(pin).detach()
}

// SweepProbeFlows deletes the direct mode's filed host-probe flows that no
// SYN used within bpfobj.ProbeFlowTTL of their connect (a probe whose SYN
// never reached the pod): the pod's programs delete the ones they pass,
// and no longer honour older ones. It returns how many it deleted. In the
// snat mode entries live as long as their socket and are left alone.
func (d *Dataplane) SweepProbeFlows() (int, error) {
	if d.cfg.HostProbes != bpfobj.ProbeDirect {
		return 0, nil
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil { // bpf_ktime_get_ns's clock
		return 0, fmt.Errorf("read the monotonic clock: %w", err)
	}
	now := uint64(ts.Nano())
	d.mu.Lock()
	defer d.mu.Unlock()
	m := d.sock.AeProbeNat
	if m == nil {
		return 0, errors.New("the data path is closed")
	}
	expired := func(v bpfobj.SockProbeNat) bool {
		return now > v.LastSeenNs && time.Duration(now-v.LastSeenNs) >= bpfobj.ProbeFlowTTL
	}
	var (
		key   bpfobj.SockProbeKey
		val   bpfobj.SockProbeNat
		stale []bpfobj.SockProbeKey
	)
	it := m.Iterate()
	for it.Next(&key, &val) {
		if expired(val) {
			stale = append(stale, key)
		}
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("read ae_probe_nat: %w", err)
	}
	n := 0
	for _, k := range stale {
		// Read again: a new probe of the same flow may have taken the
		// entry over since (it is then fresh and stays).
		if err := m.Lookup(&k, &val); err != nil || !expired(val) {
			continue
		}
		if err := m.Delete(&k); err == nil {
			n++
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			return n, fmt.Errorf("delete a stale host-probe flow from ae_probe_nat: %w", err)
		}
	}
	return n, nil
}

// linkedBelow reports whether the cgroup link l is attached to a cgroup
// below root, at most podsCgroupDepth levels down: where an earlier agent
// had its pods' cgroup (kubepods.slice, one level down on a node).
func linkedBelow(l link.Link, root string) bool {
	info, err := l.Info()
	if err != nil || info.Cgroup() == nil {
		return false
	}
	want := info.Cgroup().CgroupId
	level := []string{root}
	for range podsCgroupDepth {
		var next []string
		for _, dir := range level {
			entries, _ := os.ReadDir(dir)
			for _, e := range entries {
				if !e.IsDir() {
					continue
				}
				sub := filepath.Join(dir, e.Name())
				if id, err := hostfs.CgroupID(sub); err == nil && id == want {
					return true
				}
				next = append(next, sub)
			}
		}
		level = next
	}
	return false
}

// podsCgroupDepth bounds linkedBelow's walk: kubelet's kubepods.slice is
// one level below the root, a nested kubelet's two.
const podsCgroupDepth = 2
