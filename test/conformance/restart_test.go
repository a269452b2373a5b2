// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// The agent going away (crash, upgrade) must not stop redirection for a
// single connection: pinned links keep the programs attached, and the next
// agent adopts them in place.
func TestRestartKeepsRedirection(t *testing.T) {
	n := simnode.New(t)
	a := n.AddPod("a")
	cfg := dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	ctx := context.Background()
	// As on a node: the agent's hooks exist before ztunnel opens its
	// listeners in the pod (it does so when the agent hands it the pod).
	d1, err := dataplane.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	zt := n.StartZtunnel()
	zt.Add(a)
	app := n.StartApp(a)
	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	inbound := netip.AddrPortFrom(a.V4, appPort)
	app.Listen("tcp", "a", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	dst := netip.AddrPortFrom(simnode.OutsideV4, appPort)
	checkRedirected := func(phase string) {
		t.Helper()
		resp, err := app.Dial("tcp", simnode.AppRequest{Addr: dst})
		if err != nil {
			t.Fatalf("%s: outbound dial: %v", phase, err)
		}
		if r, ok := zt.RecordFor(resp.Local); !ok || r.Listener != standin.OutboundPort || r.OrigDst != dst {
			t.Errorf("%s: outbound connection did not go through ztunnel: %+v", phase, r)
		}
		resp, err = out.Dial("tcp", simnode.AppRequest{Addr: inbound})
		if err != nil {
			t.Fatalf("%s: inbound dial: %v", phase, err)
		}
		if r, ok := zt.RecordFor(resp.Local); !ok || r.Listener != standin.InboundPort || r.OrigDst != inbound {
			t.Errorf("%s: inbound connection did not go through ztunnel: %+v", phase, r)
		}
	}

	if err := d1.Enroll(ctx, dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs()}); err != nil {
		t.Fatal(err)
	}
	checkRedirected("agent running")
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	checkRedirected("agent gone")

	d2, err := dataplane.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d2.Uninstall() })
	if got := d2.List(); len(got) != 1 || got[0].UID != a.UID {
		t.Fatalf("restarted agent adopted %+v", got)
	}
	checkRedirected("agent restarted")
}
