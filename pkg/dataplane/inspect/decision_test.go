// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
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
		ReasonListenerFull: bpfobj.SockAeReasonAE_R_LISTENER_FULL, ReasonProbeDirect: bpfobj.SockAeReasonAE_R_PROBE_DIRECT,
	}
	if len(c) != int(reasonCount) || bpfobj.SockAeReasonAE_R_MAX != bpfobj.SockAeReason(reasonCount) {
		t.Fatalf("%d Go reasons, the C enum has %d", reasonCount, bpfobj.SockAeReasonAE_R_MAX)
	}
	for r, cr := range c {
		if uint32(r) != uint32(cr) {
			t.Errorf("%s is %d in Go, %d in bpf/include/common.h", r, r, cr)
		}
		if r != ReasonNone && (r.Decision() == DecisionNone || r.Row() == "" || r.Text() == "") {
			t.Errorf("%s says no decision, row or text", r)
		}
	}
	if bpfobj.TraceLost < int(reasonCount) {
		t.Errorf("the lost-events slot %d is a reason's", bpfobj.TraceLost)
	}
}
