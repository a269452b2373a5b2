// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"reflect"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// A socket load balancer at the cgroup root that attached before the agent
// (Cilium's kube-proxy replacement after a reboot, issue 35) turns a
// Service's address into a backend's in connect. With every program at the
// root it runs first, and ztunnel is handed the backend: the Service is
// lost to waypoints and policy. With the pods' cgroup configured
// (Config.PodsCgroup) the pods' sockets meet ours first, whatever the
// order: ztunnel's original destination and the app's getpeername are the
// Service's, a pod outside the mesh is still load-balanced, and an agent
// restart moves the links both ways, the pods running on. The same with
// per-pod socket hooks (Config.SocketHooks).
func TestSocketLoadBalancerRunsAfterOurs(t *testing.T) {
	n := simnode.New(t)
	a, backend, x := n.AddPod("a"), n.AddPod("c"), n.AddPod("x")
	zt := n.StartZtunnel()
	zt.Add(a)
	appA, appX := n.StartApp(a), n.StartApp(x)
	appA.Listen("tcp", "a", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	host := n.StartNodeApp()
	n.StartApp(backend).Listen("tcp", "c", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	vip := netip.MustParseAddrPort("198.18.255.10:80")
	be := netip.AddrPortFrom(backend.V4, appPort)
	n.AttachSocketLB(vip, be)

	cfg := ebpfConfig(n)
	cfg.HostProbes = bpfobj.ProbeDirect // the node-wide half's work
	var dp *dataplane.Dataplane
	t.Cleanup(func() {
		if dp != nil {
			if err := dp.Uninstall(); err != nil {
				t.Errorf("uninstall dataplane: %v", err)
			}
		}
	})
	restart := func(podsCgroup string, hooks ...dataplane.SocketHooks) {
		t.Helper()
		if dp != nil {
			if err := dp.Close(); err != nil {
				t.Fatal(err)
			}
		}
		cfg.PodsCgroup, cfg.SocketHooks = podsCgroup, ""
		if len(hooks) > 0 {
			cfg.SocketHooks = hooks[0]
		}
		var err error
		if dp, err = dataplane.New(cfg); err != nil {
			t.Fatalf("start the agent (pods cgroup %q): %v", podsCgroup, err)
		}
	}
	type saw struct {
		Outcome
		Remote netip.AddrPort `json:"remote"` // the client's getpeername
	}
	dial := func(app *simnode.App) saw {
		resp, err := app.Dial("tcp", simnode.AppRequest{Addr: vip})
		if err != nil {
			return saw{Outcome: Outcome{Err: "failed: " + err.Error()}}
		}
		o := saw{Outcome: Outcome{Server: resp.Reply.Server, ServerPeer: resp.Reply.Peer.Addr(), ServerAddr: resp.Reply.Local}, Remote: resp.Remote}
		if r, ok := zt.RecordSince(resp.Local, resp.Start); ok {
			o.Ztunnel = &ZtunnelSaw{Listener: r.Listener, OrigDst: r.OrigDst, From: r.OrigDstFrom}
		}
		return o
	}
	check := func(name string, got, want saw) {
		t.Helper()
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s\n got: %s\nwant: %s", name, js(got), js(want))
		}
	}
	server := Outcome{Server: "c", ServerAddr: be}
	meshed := func(orig netip.AddrPort) saw {
		o := server
		o.ServerPeer = a.V4
		o.Ztunnel = &ZtunnelSaw{Listener: standin.OutboundPort, OrigDst: orig, From: "SO_ORIGINAL_DST"}
		return saw{Outcome: o, Remote: orig}
	}
	outside := server
	outside.ServerPeer = x.V4

	restart("")
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs()}); err != nil {
		t.Fatal(err)
	}
	// The reproduction: at the root, after the load balancer.
	check("at the root, after the load balancer: ztunnel is handed the backend", dial(appA), meshed(be))

	onPodsCgroup := func(where string) {
		t.Helper()
		check(where+": ztunnel is handed the Service", dial(appA), meshed(vip))
		check(where+": a pod outside the mesh is load-balanced", dial(appX), saw{Outcome: outside, Remote: vip})
		probesDirect(t, n, host, zt, a, where)
	}
	restart(n.PodsCgroup)
	onPodsCgroup("on the pods' cgroup")

	restart("")
	check("moved back to the root", dial(appA), meshed(be))

	// Per-pod socket hooks start on a node without enrolled pods.
	if err := dp.Remove(context.Background(), a.UID); err != nil {
		t.Fatal(err)
	}
	restart(n.PodsCgroup, dataplane.SocketHooksPods)
	if err := dp.AttachZtunnel(n.ZtunnelCgroup()); err != nil {
		t.Fatal(err)
	}
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs()}); err != nil {
		t.Fatal(err)
	}
	onPodsCgroup("on each pod's cgroup")
}

// probesDirect checks that the node's own connections to pod a, host
// probes, reach its app unredirected from the node's address (the direct
// mode, done by the node-wide half at the root), and that their
// translations go with them.
func probesDirect(t *testing.T, n *simnode.Node, host *simnode.App, zt *simnode.Ztunnel, a *simnode.Pod, where string) {
	t.Helper()
	for _, ip := range a.IPs() {
		dst := netip.AddrPortFrom(ip, appPort)
		resp, err := host.Dial("tcp", simnode.AppRequest{Addr: dst})
		got := Outcome{Err: "failed"}
		if err == nil {
			got = Outcome{Server: resp.Reply.Server, ServerPeer: resp.Reply.Peer.Addr(), ServerAddr: resp.Reply.Local}
			if r, ok := zt.RecordSince(resp.Local, resp.Start); ok {
				got.Ztunnel = &ZtunnelSaw{Listener: r.Listener, OrigDst: r.OrigDst}
			}
		}
		want := Outcome{Server: "a", ServerPeer: simnode.GatewayV4, ServerAddr: dst}
		if ip.Is6() {
			want.ServerPeer = simnode.GatewayV6
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s, a host probe to %s\n got: %s\nwant: %s", where, dst, js(got), js(want))
		}
	}
	probeEntriesGoAway(t, n)
}
