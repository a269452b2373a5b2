// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The Go names of reasons are the C enum's, number for number.
func TestReasonsAreTheProgramsEnum(t *testing.T) {
	c := map[Reason]bpfobj.SockAeReason{
		ReasonNone: bpfobj.SockAeReasonAE_R_NONE, ReasonNotEnrolled: bpfobj.SockAeReasonAE_R_NOT_ENROLLED, ReasonZtunnelMark: bpfobj.SockAeReasonAE_R_ZTUNNEL_MARK,
		ReasonLoopback: bpfobj.SockAeReasonAE_R_LOOPBACK, ReasonOwnIP: bpfobj.SockAeReasonAE_R_OWN_IP, ReasonProbeDest: bpfobj.SockAeReasonAE_R_PROBE_DEST,
		ReasonUDPNotDNS: bpfobj.SockAeReasonAE_R_UDP_NOT_DNS, ReasonDNSCaptureOff: bpfobj.SockAeReasonAE_R_DNS_CAPTURE_OFF, ReasonNotTCP: bpfobj.SockAeReasonAE_R_NOT_TCP,
		ReasonOutbound: bpfobj.SockAeReasonAE_R_OUTBOUND, ReasonDNS: bpfobj.SockAeReasonAE_R_DNS, ReasonOrigDstError: bpfobj.SockAeReasonAE_R_ORIG_DST_ERROR,
		ReasonInbound: bpfobj.SockAeReasonAE_R_INBOUND, ReasonIngressMode: bpfobj.SockAeReasonAE_R_INGRESS_MODE, ReasonHBONE: bpfobj.SockAeReasonAE_R_HBONE,
		ReasonFromPod: bpfobj.SockAeReasonAE_R_FROM_POD, ReasonZtunnelDelivery: bpfobj.SockAeReasonAE_R_ZTUNNEL_DELIVERY, ReasonProbeSource: bpfobj.SockAeReasonAE_R_PROBE_SOURCE,
		ReasonNoListener: bpfobj.SockAeReasonAE_R_NO_LISTENER, ReasonAssignError: bpfobj.SockAeReasonAE_R_ASSIGN_ERROR, ReasonReroute: bpfobj.SockAeReasonAE_R_REROUTE,
		ReasonProbeSNAT: bpfobj.SockAeReasonAE_R_PROBE_SNAT, ReasonForwarded: bpfobj.SockAeReasonAE_R_FORWARDED, ReasonProbePortTaken: bpfobj.SockAeReasonAE_R_PROBE_PORT_TAKEN,
		ReasonProbeTableFull: bpfobj.SockAeReasonAE_R_PROBE_TABLE_FULL, ReasonRewriteError: bpfobj.SockAeReasonAE_R_REWRITE_ERROR,
		ReasonOrigDstFull: bpfobj.SockAeReasonAE_R_ORIG_DST_FULL, ReasonLocalFlowFull: bpfobj.SockAeReasonAE_R_LOCAL_FLOW_FULL,
		ReasonListenerFull: bpfobj.SockAeReasonAE_R_LISTENER_FULL,
	}
	if len(c) != int(reasonCount) || bpfobj.SockAeReasonAE_R_MAX != bpfobj.SockAeReason(reasonCount) {
		t.Fatalf("%d Go reasons, the C enum has %d", reasonCount, bpfobj.SockAeReasonAE_R_MAX)
	}
	for r, cr := range c {
		if uint32(r) != uint32(cr) {
			t.Errorf("%s is %d in Go, %d in bpf/common.h", r, r, cr)
		}
		if r != ReasonNone && (r.Decision() == DecisionNone || r.Row() == "" || r.Text() == "") {
			t.Errorf("%s says no decision, row or text", r)
		}
	}
	if bpfobj.TraceLost < int(reasonCount) {
		t.Errorf("the lost-events slot %d is a reason's", bpfobj.TraceLost)
	}
}

func traceFlag(t *testing.T, n *simnode.Node) uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", bpfobj.TraceFlagMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var on uint32
	if err := m.Lookup(uint32(0), &on); err != nil {
		t.Fatal(err)
	}
	return on
}

func setTraceFlag(t *testing.T, n *simnode.Node, on uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", bpfobj.TraceFlagMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Put(uint32(0), on); err != nil {
		t.Fatal(err)
	}
}

// The programs' flag is on exactly while a tracer is open; one tracer at
// a time; a restarted agent keeps a live tracer's flag and switches off
// one a dead tracer left on.
func TestTracingIsOnOnlyWhileATracerIsOpen(t *testing.T) {
	n := simnode.New(t)
	d := newDataplane(t, n)
	if on := traceFlag(t, n); on != 0 {
		t.Fatalf("flag %d with nobody tracing", on)
	}
	tr, err := OpenTracer(n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	if on := traceFlag(t, n); on != 1 {
		t.Errorf("flag %d while tracing", on)
	}
	if _, err := OpenTracer(n.BPFFSDir); !errors.Is(err, ErrTraceBusy) {
		t.Errorf("a second tracer: %v, want ErrTraceBusy", err)
	}
	// An agent restarting under a live tracer keeps the events on.
	d.Close()
	d = newDataplane(t, n)
	if on := traceFlag(t, n); on != 1 {
		t.Errorf("flag %d after a restart under a live tracer", on)
	}
	done := make(chan error, 1)
	go func() { _, err := tr.Read(); done <- err }()
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, os.ErrClosed) {
		t.Errorf("Read blocked across Close returned %v, want os.ErrClosed", err)
	}
	if on := traceFlag(t, n); on != 0 {
		t.Errorf("flag %d after Close", on)
	}
	if err := tr.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
	// A tracer that died (no lock held) left the flag on.
	setTraceFlag(t, n, 1)
	d.Close()
	newDataplane(t, n)
	if on := traceFlag(t, n); on != 0 {
		t.Errorf("flag %d after a restart with no tracer", on)
	}
	if _, err := OpenTracer(t.TempDir()); !errors.Is(err, ErrNotInstalled) {
		t.Errorf("a tracer of nothing pinned: %v, want ErrNotInstalled", err)
	}
}
