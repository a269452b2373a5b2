// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// A filed host-probe flow that no SYN used (its SYN was lost before the
// pod) goes at the sweep once it is older than bpfobj.ProbeFlowTTL; a
// fresh one stays, and in the snat mode, where entries live as long as
// their socket, nothing is swept.
func TestSweepProbeFlowsTakesOnlyExpiredOnes(t *testing.T) {
	n := simnode.New(t)
	d := newDataplane(t, n) // direct, the default
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	now := uint64(ts.Nano())
	key := func(port uint16) bpfobj.SockProbeKey {
		var k bpfobj.SockProbeKey
		k.Pod = bpfobj.AddrKey(netip.MustParseAddr("198.18.0.77"))
		k.PodPort, k.HostPort = htons(8080), htons(port)
		return k
	}
	entry := func(age time.Duration) bpfobj.SockProbeNat {
		var v bpfobj.SockProbeNat
		v.Host = bpfobj.AddrKey(simnode.GatewayV4)
		v.LastSeenNs = now - uint64(age)
		return v
	}
	old, fresh := key(40001), key(40002)
	for k, v := range map[bpfobj.SockProbeKey]bpfobj.SockProbeNat{old: entry(bpfobj.ProbeFlowTTL + time.Second), fresh: entry(time.Second)} {
		if err := d.sock.AeProbeNat.Put(&k, &v); err != nil {
			t.Fatal(err)
		}
	}
	n1, err := d.SweepProbeFlows()
	if err != nil || n1 != 1 {
		t.Fatalf("SweepProbeFlows = %d, %v; want 1 (the expired entry)", n1, err)
	}
	var v bpfobj.SockProbeNat
	if err := d.sock.AeProbeNat.Lookup(&old, &v); err == nil {
		t.Errorf("the expired entry is still there")
	}
	if err := d.sock.AeProbeNat.Lookup(&fresh, &v); err != nil {
		t.Errorf("the fresh entry went: %v", err)
	}

	d.cfg.HostProbes = bpfobj.ProbeSNAT
	stale := entry(time.Hour)
	if err := d.sock.AeProbeNat.Put(&old, &stale); err != nil {
		t.Fatal(err)
	}
	if n2, err := d.SweepProbeFlows(); err != nil || n2 != 0 {
		t.Errorf("SweepProbeFlows in the snat mode = %d, %v; want 0", n2, err)
	}
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }
