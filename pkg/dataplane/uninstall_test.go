// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// A connection captured just before an uninstall, still in ztunnel's
// backlog when capture ends, is told its original destination: Uninstall
// waits for ztunnel to read it before cgroup/getsockopt goes. Without
// the wait ztunnel was told the pod's own listener address (seen once in
// a hand-back to istio-cni under emulation: one outbound connection of
// 17599 failed). ztunnel here accepts only after capture ended and
// Uninstall would, without the wait, have detached everything.
func TestUninstallWaitsForZtunnelToReadOriginalDestinations(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	accepted := make(chan []simnode.AppResponse, 1)
	var once sync.Once
	zt := n.StartApp(p)
	late := func() {
		time.Sleep(300 * time.Millisecond) // Uninstall would be done by now
		var got []simnode.AppResponse
		for _, name := range []string{"v4", "v6"} {
			resp, err := zt.Do(simnode.AppRequest{Op: "accept-orig-dst", Name: name})
			if err != nil {
				t.Errorf("accept %s: %v", name, err)
			}
			got = append(got, resp)
		}
		accepted <- got
	}
	d, err := New(Config{
		BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS),
		Failpoint: func(step string) {
			if step == StepUninstallCaptureEnded {
				once.Do(func() { go late() }) // not again in the cleanup's Uninstall
			}
		},
	})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if err := d.Enroll(context.Background(), podOf(p)); err != nil {
		t.Fatal(err)
	}
	zt.Do(simnode.AppRequest{Op: "listen-hold", Name: "v4", Addr: netip.AddrPortFrom(p.V4, standin.OutboundPort)})
	zt.Do(simnode.AppRequest{Op: "listen-hold", Name: "v6", Addr: netip.AddrPortFrom(p.V6, standin.OutboundPort)})
	app := n.StartApp(p)
	want := map[string]netip.AddrPort{
		"v4": netip.MustParseAddrPort("198.19.255.1:8080"),
		"v6": netip.MustParseAddrPort("[fd00:198:18:ffff::1]:8080"),
	}
	local := map[string]netip.AddrPort{}
	for _, name := range []string{"v4", "v6"} {
		resp, err := app.Do(simnode.AppRequest{Op: "stream-open", Name: name, Addr: want[name]})
		if err != nil {
			t.Fatalf("connect %s: %v", want[name], err)
		}
		local[name] = resp.Local
	}
	if err := d.Uninstall(); err != nil {
		t.Errorf("Uninstall: %v", err)
	}
	got := <-accepted
	for i, name := range []string{"v4", "v6"} {
		if got[i].Remote != local[name] || got[i].OrigDst != want[name] {
			t.Errorf("%s: ztunnel accepted %s with original destination %s; want %s from %s", name, got[i].Remote, got[i].OrigDst, want[name], local[name])
		}
	}
}
