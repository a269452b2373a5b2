// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"testing"

	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

// Which conntrack entries hold the drain (RedirectedFlows): redirected
// ones that saw a reply and are not over. The states are the kernel's
// (enum tcp_conntrack); the SYN_SENT case is the entry seen holding a
// takeover's drain for two minutes: a client's SYN, DNATed to 15006 with
// its port remapped, that nobody answered.
func TestRedirectedCountsRepliedLiveFlowsOnly(t *testing.T) {
	const (
		synSent     = 1
		established = 3
	)
	flow := func(status conntrack.Status, replyPort uint16, state uint8) conntrack.Flow {
		var f conntrack.Flow
		f.Status = status
		f.TupleOrig.Proto.Protocol = unix.IPPROTO_TCP
		f.TupleReply.Proto.SourcePort = replyPort
		f.ProtoInfo.TCP = &conntrack.ProtoInfoTCP{State: state}
		return f
	}
	nat := conntrack.StatusDstNAT | conntrack.StatusConfirmed
	replied := nat | conntrack.StatusSeenReply
	for _, c := range []struct {
		name string
		f    conntrack.Flow
		want bool
	}{
		{"established to 15001", flow(replied, 15001, established), true},
		{"established to 15006", flow(replied, 15006, established), true},
		{"established to 15053", flow(replied, 15053, established), true},
		{"in TIME_WAIT", flow(replied, 15001, tcpConntrackTimeWait), false},
		{"in CLOSE", flow(replied, 15006, tcpConntrackClose), false},
		{"a SYN nobody answered", flow(nat, 15006, synSent), false},
		{"not NATed", flow(conntrack.StatusSeenReply|conntrack.StatusConfirmed, 15006, established), false},
		{"NATed elsewhere", flow(replied, 8080, established), false},
	} {
		if got := redirected(c.f); got != c.want {
			t.Errorf("%s: redirected = %v, want %v", c.name, got, c.want)
		}
	}
}
