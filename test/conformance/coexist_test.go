// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// A primary CNI's TC programs on every interface the data path uses (the
// pod's eth0 and lo, both directions of the node side of its veth; TCX
// links where the kernel has them, which run before our classic filters,
// else classic filters of a lower priority) keep seeing the traffic, and
// redirection works through them: inbound capture, ztunnel's delivery
// over lo (R10) and host-probe SNAT (H1).
func TestCoexistsWithThePrimaryCNIsPrograms(t *testing.T) {
	n := simnode.New(t)
	a := n.AddPod("a")
	d, err := dataplane.New(ebpfConfig(n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })

	// The primary CNI's programs count every packet and pass it on.
	hooks := []struct {
		ns, iface string
		attach    ebpf.AttachType
	}{
		{a.NS, "eth0", ebpf.AttachTCXIngress},
		{a.NS, "lo", ebpf.AttachTCXIngress},
		{n.NodeNS, a.HostVeth, ebpf.AttachTCXEgress},
		{n.NodeNS, a.HostVeth, ebpf.AttachTCXIngress},
	}
	counters := make([]*ebpf.Map, len(hooks))
	for i, h := range hooks {
		counters[i] = attachCounter(t, n, h.ns, h.iface, h.attach)
	}

	zt := n.StartZtunnel()
	zt.Add(a)
	app := n.StartApp(a)
	app.Listen("tcp", "a", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs()}); err != nil {
		t.Fatal(err)
	}

	inbound := netip.AddrPortFrom(a.V4, appPort)
	out := n.StartOutsideApp()
	resp, err := out.Dial("tcp", simnode.AppRequest{Addr: inbound})
	if err != nil {
		t.Fatalf("inbound dial: %v", err)
	}
	if r, ok := zt.RecordFor(resp.Local); !ok || r.Listener != standin.InboundPort || r.OrigDst != inbound {
		t.Errorf("inbound connection did not go through ztunnel: %+v", r)
	}
	if resp.Reply == nil || resp.Reply.Server != "a" || resp.Reply.Peer.Addr() != simnode.OutsideV4 {
		t.Errorf("inbound reply %+v, want the app seeing the client's address", resp.Reply)
	}
	host := n.StartNodeApp()
	resp, err = host.Dial("tcp", simnode.AppRequest{Addr: inbound})
	if err != nil {
		t.Fatalf("probe dial: %v", err)
	}
	if resp.Reply == nil || resp.Reply.Peer.Addr() != simnode.ProbeV4 {
		t.Errorf("probe reply %+v, want the app seeing the probe address", resp.Reply)
	}
	for i, h := range hooks {
		var packets uint64
		if err := counters[i].Lookup(uint32(0), &packets); err != nil {
			t.Fatal(err)
		}
		if packets == 0 {
			t.Errorf("the primary CNI's program on %s %s saw no packet", h.iface, h.attach)
		}
	}
}

// attachCounter attaches, in netns ns, a program that counts packets and
// passes them on (TCX_NEXT): a TCX link where the kernel has TCX, else a
// classic filter ahead of ours.
func attachCounter(t *testing.T, n *simnode.Node, ns, iface string, attach ebpf.AttachType) *ebpf.Map {
	t.Helper()
	counter, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { counter.Close() })
	spec := &ebpf.ProgramSpec{
		Type: ebpf.SchedCLS, AttachType: attach, License: "GPL",
		Instructions: asm.Instructions{
			asm.StoreImm(asm.RFP, -4, 0, asm.Word),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -4),
			asm.LoadMapPtr(asm.R1, counter.FD()),
			asm.FnMapLookupElem.Call(),
			asm.JEq.Imm(asm.R0, 0, "next"),
			asm.Mov.Imm(asm.R1, 1),
			asm.StoreXAdd(asm.R0, asm.R1, asm.DWord),
			asm.Mov.Imm(asm.R0, -1).WithSymbol("next"), // TCX_NEXT
			asm.Return(),
		},
	}
	if !features.HasTCX() {
		spec.AttachType = ebpf.AttachNone // classic tc programs carry none before TCX
	}
	prog, err := ebpf.NewProgram(spec)
	if err != nil {
		t.Fatalf("load the primary CNI's program: %v", err)
	}

	t.Cleanup(func() { prog.Close() })
	if features.HasTCX() {
		n.AttachTCX(ns, iface, attach, prog)
	} else {
		n.AddTCFilter(ns, iface, attach, prog, "primary-cni")
	}
	return counter
}
