// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// The kernel gives the node's sockets one source port towards two pods at
// once: the ambient pod's connection passes ztunnel (its record names the
// port), the plain pod's does not. Only the first counts as through
// ztunnel; the plain pod's sample is no capture.
func TestJudgeTellsFlowsThatShareASourcePort(t *testing.T) {
	at := time.Date(2026, 12, 5, 19, 41, 28, 0, time.UTC)
	client := "198.18.0.1:45144"
	ambientDst, plainDst := netip.MustParseAddrPort("198.18.0.3:8080"), netip.MustParseAddrPort("198.18.0.5:8080")
	samples := []sample{
		{At: at, From: "node", Target: "a1", Dst: ambientDst, Local: client, Server: "a1", Peer: client},
		{At: at.Add(100 * time.Millisecond), From: "node", Target: "p1", Dst: plainDst, Local: client, Server: "p1", Peer: client},
	}
	records := []standin.Record{{Time: at, Listener: standin.InboundPort, Peer: netip.MustParseAddrPort(client), OrigDst: ambientDst}}
	v := judge(samples, records, map[string]bool{"a1": true})
	if len(v.Bypass) != 0 || len(v.Captured) != 0 || v.Answered != 2 {
		t.Errorf("judge: %s", v)
	}
}
