// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"net/netip"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The agent is killed with SIGKILL while a redirected TCP stream runs and
// new connections keep coming; then it starts again. The stream never
// breaks, every connection meanwhile goes through ztunnel, and the new
// agent adopts the pod (contract section 6; Kmesh's restart bypass is the
// failure this guards against).
func TestAgentSIGKILLKeepsRedirection(t *testing.T) {
	n := newAgentNode(t, "app")
	a := n.pods["app"]
	n.StartReadyAgent(t)
	zt := n.StartZtunnelFor(n.ZDS)
	n.WaitZtunnel(t)
	if resp, err := n.podAdd(t, a); err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}

	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 9090)}); err != nil {
		t.Fatal(err)
	}
	app := n.StartApp(a)
	probe, err := simnode.StartTrafficProbe(app, zt, netip.AddrPortFrom(simnode.OutsideV4, 9090), netip.AddrPortFrom(simnode.OutsideV4, 8080))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	n.Agent.Kill()
	time.Sleep(time.Second) // no agent at all
	n.StartReadyAgent(t)
	time.Sleep(500 * time.Millisecond)
	conns, failures := probe.Stop()
	if len(failures) > 0 {
		t.Errorf("%d failures around the restart (of %d connections), first: %v", len(failures), conns, failures[:min(5, len(failures))])
	}
	if conns < 10 {
		t.Errorf("only %d connections were tried", conns)
	}
	if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 1 || got[0].UID != a.UID {
		t.Errorf("after the restart the pins hold %+v", got)
	}
	// The restarted agent knows the pod: its removal works end to end.
	n.podDel(t, a)
	if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 0 {
		t.Errorf("after DEL the pins hold %+v", got)
	}
}
