// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// With --socket-hooks=pods the agent attaches the socket programs to
// ztunnel's cgroup when it says hello over ZDS (from its PID's cgroup) and
// to each enrolled pod's: the enrolled pod's outbound goes through
// ztunnel with its original destination, a pod outside the mesh has none
// of them, and after ztunnel restarts in a new cgroup its programs follow.
func TestAgentWithPerPodSocketHooks(t *testing.T) {
	n := newAgentNode(t, "app", "plain")
	a, plain := n.pods["app"], n.pods["plain"]
	n.StartReadyAgent(t, "--uninstall-on-exit", "--socket-hooks=pods")
	zt := n.StartZtunnelFor(n.ZDS)
	n.WaitZtunnel(t)
	full := len(bpfobj.CgroupHooks())
	if got := simnode.SocketProgramsOn(t, n.ZtunnelCgroup()); got != full {
		t.Fatalf("%d programs on ztunnel's cgroup after its hello, want %d; agent:\n%s", got, full, n.Agent.Output.String())
	}
	for _, p := range []*simnode.Pod{a, plain} {
		if _, err := n.podAdd(t, p); err != nil {
			t.Fatalf("ADD %s: %v", p.Name, err)
		}
	}
	// The node-wide half on the root, unless host probes are filed at
	// tcp_connect (where the kernel takes fentry).
	half := len(bpfobj.NodeScopeHooks())
	if _, err := os.Stat(filepath.Join(n.BPFFSDir, "links", bpfobj.ProbeConnectPin)); err == nil {
		half = 0
	}
	for dir, want := range map[string]int{a.Cgroup: full, plain.Cgroup: 0, n.PodsCgroup: 0, n.CgroupRoot: half} {
		if got := simnode.SocketProgramsOn(t, dir); got != want {
			t.Errorf("%d programs on %s, want %d", got, dir, want)
		}
	}
	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	dst := netip.AddrPortFrom(simnode.OutsideV4, 8080)
	dial := func(p *simnode.Pod) (standin.Record, bool) {
		t.Helper()
		r, err := n.StartApp(p).Dial("tcp", simnode.AppRequest{Addr: dst})
		if err != nil {
			t.Fatalf("outbound dial from %s: %v", p.Name, err)
		}
		return zt.RecordSince(r.Local, r.Start)
	}
	if rec, ok := dial(a); !ok || rec.Listener != standin.OutboundPort || rec.OrigDst != dst || rec.OrigDstFrom != "SO_ORIGINAL_DST" {
		t.Errorf("the enrolled pod's outbound: ztunnel saw %+v (%v)", rec, ok)
	}
	if rec, ok := dial(plain); ok {
		t.Errorf("the pod outside the mesh went through ztunnel: %+v", rec)
	}

	// A new ztunnel in a cgroup of its own: its hello brings the programs.
	zt.Stop()
	cg2 := n.PodsCgroupDir("ztunnel-2")
	zt2 := n.StartZtunnelForIn(n.ZDS, cg2)
	if !testenv.Poll(10*time.Second, func() bool { return simnode.SocketProgramsOn(t, cg2) == full }) {
		t.Fatalf("the new ztunnel's cgroup never got the programs; agent:\n%s", n.Agent.Output.String())
	}
	n.WaitZtunnel(t)
	zt = zt2
	if rec, ok := dial(a); !ok || rec.OrigDst != dst {
		t.Errorf("after ztunnel's restart, the enrolled pod's outbound: %+v (%v)", rec, ok)
	}
	if !strings.Contains(n.Agent.Output.String(), "ztunnel's cgroup has the socket programs") {
		t.Errorf("the agent did not log ztunnel's cgroup")
	}
}
