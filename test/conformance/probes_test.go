// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// The direct host-probe mode (docs/CONTRACT.md, "Host probes"): the node's
// own connections to an enrolled pod reach the app untranslated, with the
// node's address, exactly as istio-cni's `-m owner --socket-exists` rule
// picks them, and nothing else does: traffic forwarded through the node,
// and packets from another netns that carry the node's address or the
// probe address, are captured.
func TestHostProbesDirect(t *testing.T) {
	b := &ebpfBackend{probes: bpfobj.ProbeDirect, split: true}
	e := newEnv(t, b)
	t.Run("nothing_on_the_node_side_of_the_veths", func(t *testing.T) {
		for _, p := range []*simnode.Pod{e.a, e.bpod, e.d, e.e} {
			if got := nodeSideFilters(t, e.node, p); len(got) != 0 {
				t.Errorf("pod %s: filters on %s: %v", p.Name, p.HostVeth, got)
			}
		}
	})
	t.Run("probes_filed_at_connect_where_the_kernel_allows", func(t *testing.T) { probesFiledAtConnect(t, e.node) })
	defer t.Run("H1_direct_flows_of_finished_probes_go_away", func(t *testing.T) { probeEntriesGoAway(t, e.node) })
	runScenarios(t, e, directScenarios(), &outcomes{got: map[string]map[string]Outcome{}})
}

// directScenarios are H1-H3 in the direct mode.
func directScenarios() []scenario {
	node := func(f family) netip.Addr { return f.pick(simnode.GatewayV4, simnode.GatewayV6) }
	probe := func(f family) netip.Addr { return f.pick(simnode.ProbeV4, simnode.ProbeV6) }
	fromNode := func(pod func(*env) *simnode.Pod, server string, bind func(family) netip.Addr) func(*testing.T, *env, family) (Outcome, Outcome) {
		return func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			p := pod(e)
			dst := netip.AddrPortFrom(f.pick(p.V4, p.V6), appPort)
			req := simnode.AppRequest{Addr: dst}
			peer := node(f)
			if bind != nil {
				req.Bind, peer = netip.AddrPortFrom(bind(f), 0), bind(f)
			}
			got := e.observe(e.host.Dial("tcp", req))
			return got, Outcome{Server: server, ServerPeer: peer, ServerAddr: dst}
		}
	}
	return []scenario{
		{"H1_direct_probe_node_address", allFamilies, fromNode(func(e *env) *simnode.Pod { return e.a }, "a", nil)},
		{"H1_direct_probe_ingress_mode", allFamilies, fromNode(func(e *env) *simnode.Pod { return e.d }, "d", nil)},
		// A node socket is a probe whatever address it sends from.
		{"H1_direct_probe_bound_to_probe_address", allFamilies, fromNode(func(e *env) *simnode.Pod { return e.a }, "a", probe)},
		{"H2_direct_forwarded_captured", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.InboundPort, OrigDst: dst}}
		}},
		{"H2_direct_node_address_from_another_netns_captured", allFamilies, spoofedSource(node)},
		{"R7_direct_probe_address_from_another_netns_captured", allFamilies, spoofedSource(probe)},
		{"H3_direct_pod_outside_mesh_untouched", allFamilies, fromNode(func(e *env) *simnode.Pod { return e.c }, "c", nil)},
	}
}

// spoofedSource sends a SYN to pod a from pod c (outside the mesh) with a
// source address c does not own: the node's, or the probe address. Its
// SYN-ACK goes to the node, which owns the address and has no such
// connection, so the connection fails either way; what counts is the
// pod's decision on the SYN: captured, not passed as a host probe. An
// IPv4 node drops a packet from one of its own addresses that it did not
// send, unless accept_local is set: it is, for the SYN to get there.
func spoofedSource(src func(family) netip.Addr) func(*testing.T, *env, family) (Outcome, Outcome) {
	return func(t *testing.T, e *env, f family) (Outcome, Outcome) {
		if f == v4 {
			e.node.Sysctl(e.node.NodeNS, "net/ipv4/conf/all/accept_local", "1")
			defer e.node.Sysctl(e.node.NodeNS, "net/ipv4/conf/all/accept_local", "0")
		}
		dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
		before := decisionCounts(t, e.node)
		// The SYN's decision is what counts: the dial need not wait for
		// the connection's failure, only for the counters to move.
		_, err := e.appC.Dial("tcp", simnode.AppRequest{Addr: dst, Bind: netip.AddrPortFrom(src(f), 0), Transparent: true, Timeout: 500 * time.Millisecond})
		var after map[inspect.Reason]uint64
		testenv.Poll(3*time.Second, func() bool {
			after = decisionCounts(t, e.node)
			return after[inspect.ReasonInbound] > before[inspect.ReasonInbound]
		})
		got := Outcome{Summary: fmt.Sprintf("connected=%t captured=%t passed_as_probe=%t passed_from_probe_address=%t", err == nil,
			after[inspect.ReasonInbound] > before[inspect.ReasonInbound], after[inspect.ReasonProbeDirect] > before[inspect.ReasonProbeDirect],
			after[inspect.ReasonProbeSource] > before[inspect.ReasonProbeSource])}
		return got, Outcome{Summary: "connected=false captured=true passed_as_probe=false passed_from_probe_address=false"}
	}
}

func decisionCounts(t *testing.T, n *simnode.Node) map[inspect.Reason]uint64 {
	t.Helper()
	view, err := inspect.OpenPinned(n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	d, err := view.Decisions()
	if err != nil {
		t.Fatal(err)
	}
	return d.ByReason
}

// probeEntriesGoAway waits for ae_probe_nat to empty: every entry, a
// translation or a filed flow, leaves with the prober's socket.
func probeEntriesGoAway(t *testing.T, n *simnode.Node) {
	t.Helper()
	var left []inspect.ProbeNATEntry
	if !testenv.Poll(5*time.Second, func() bool {
		view, err := inspect.OpenPinned(n.BPFFSDir)
		if err != nil {
			t.Fatal(err)
		}
		d, err := view.Dump()
		view.Close()
		if err != nil {
			t.Fatal(err)
		}
		left = d.ProbeNAT
		return len(left) == 0
	}) {
		t.Fatalf("%d host-probe entries left after every probe ended: %+v", len(left), left[:min(3, len(left))])
	}
}

// probesFiledAtConnect checks where the direct mode files the node's
// probes: at tcp_connect() (bpf/probe.c, links/probe_connect) where the
// kernel takes fentry programs, with nothing on the node's cgroup root;
// elsewhere by the node-wide half of the socket programs on the root (the
// links node_*). The amd64 kernels of the matrix take fentry (make
// test-kernels sets AMBIENT_EBPF_GUEST); the CI machine's refuses it by
// policy.
func probesFiledAtConnect(t *testing.T, n *simnode.Node) {
	t.Helper()
	links := filepath.Join(n.BPFFSDir, "links")
	_, err := os.Stat(filepath.Join(links, bpfobj.ProbeConnectPin))
	atConnect := err == nil
	if atConnect != features.HasFentryTCPConnect() {
		t.Fatalf("links/%s pinned: %v, fentry on tcp_connect: %v", bpfobj.ProbeConnectPin, atConnect, features.HasFentryTCPConnect())
	}
	// Debian's amd64 kernels of the matrix take fentry (arm64's from 6.0
	// may, and fall back to the node-wide half where they do not).
	if os.Getenv("AMBIENT_EBPF_GUEST") != "" && runtime.GOARCH == "amd64" && !atConnect {
		t.Errorf("a kernel of the matrix refuses fentry on tcp_connect: the node-wide half is attached instead")
	}
	for _, h := range bpfobj.NodeScopeHooks() {
		_, err := os.Stat(filepath.Join(links, h.Name))
		if pinned := err == nil; pinned == atConnect {
			t.Errorf("links/%s pinned: %v, with probes filed at connect: %v", h.Name, pinned, atConnect)
		}
	}
	root := rootPrograms(t, n)
	t.Logf("probes filed at connect: %v; programs on the node's cgroup root: %v", atConnect, root)
	if atConnect && len(root) != 0 {
		t.Errorf("programs on the node's cgroup root with probes filed at connect: %v", root)
	}
}

// rootPrograms lists the programs attached to the simulated node's cgroup
// root, by attach type.
func rootPrograms(t *testing.T, n *simnode.Node) []string {
	t.Helper()
	f, err := os.Open(n.CgroupRoot)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	for _, a := range []ebpf.AttachType{ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect, ebpf.AttachCGroupSockOps} {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: a})
		if err != nil {
			t.Fatalf("query %v programs on %s: %v", a, n.CgroupRoot, err)
		}
		for range q.Programs {
			out = append(out, a.String())
		}
	}
	return out
}

// nodeSideFilters lists the tc filters on the node side of a pod's veth.
func nodeSideFilters(t *testing.T, n *simnode.Node, p *simnode.Pod) []string {
	t.Helper()
	var names []string
	err := simnode.InNetns(n.NodeNS, func() error {
		ifc, err := net.InterfaceByName(p.HostVeth)
		if err != nil {
			return err
		}
		for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
			fs, err := netlink.FilterList(&netlink.Dummy{LinkAttrs: netlink.LinkAttrs{Index: ifc.Index}}, parent)
			if err != nil {
				return err
			}
			for _, f := range fs {
				name := f.Type()
				if bf, ok := f.(*netlink.BpfFilter); ok {
					name = bf.Name
				}
				names = append(names, fmt.Sprintf("%s@%d", name, f.Attrs().Priority))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("list filters on %s: %v", p.HostVeth, err)
	}
	return names
}

// Where a primary CNI drops a pod's replies to the link-local probe
// address (simnode.DropRepliesTo), kubelet's probes fail in the SNAT mode
// and pass in the direct one; the mode changes with an agent restart,
// the pod running on, in both directions.
func TestHostProbesWhereLinkLocalRepliesAreDropped(t *testing.T) {
	n := simnode.New(t)
	a := n.AddPod("a")
	zt := n.StartZtunnel()
	zt.Add(a)
	app := n.StartApp(a)
	app.Listen("tcp", "a", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	host := n.StartNodeApp()

	cfg := ebpfConfig(n)
	var dp *dataplane.Dataplane
	t.Cleanup(func() {
		if dp != nil {
			if err := dp.Uninstall(); err != nil {
				t.Errorf("uninstall dataplane: %v", err)
			}
		}
	})
	restart := func(mode bpfobj.ProbeMode) {
		t.Helper()
		if dp != nil {
			if err := dp.Close(); err != nil {
				t.Fatalf("stop the agent: %v", err)
			}
		}
		cfg.HostProbes = mode
		var err error
		if dp, err = dataplane.New(cfg); err != nil {
			t.Fatalf("start the agent in the %s mode: %v", mode, err)
		}
	}
	failed := func(family) Outcome { return Outcome{Err: "failed"} }
	probe := func(t *testing.T, want func(f family) Outcome) {
		t.Helper()
		for _, f := range allFamilies {
			dst := netip.AddrPortFrom(f.pick(a.V4, a.V6), appPort)
			req := simnode.AppRequest{Addr: dst}
			if reflect.DeepEqual(want(f), failed(f)) {
				req.Timeout = time.Second // its SYN-ACKs are dropped: no retransmission gets through either
			}
			resp, err := host.Dial("tcp", req)
			got := Outcome{Err: "failed"}
			if err == nil {
				got = Outcome{Server: resp.Reply.Server, ServerPeer: resp.Reply.Peer.Addr(), ServerAddr: resp.Reply.Local}
				if _, ok := zt.RecordSince(resp.Local, resp.Start); ok {
					got.Ztunnel = &ZtunnelSaw{}
				}
			}
			if w := want(f); !reflect.DeepEqual(got, w) {
				t.Errorf("%s probe to %s\n got: %s\nwant: %s", f, dst, js(got), js(w))
			}
		}
	}
	reached := func(peer func(f family) netip.Addr) func(f family) Outcome {
		return func(f family) Outcome {
			return Outcome{Server: "a", ServerPeer: peer(f), ServerAddr: netip.AddrPortFrom(f.pick(a.V4, a.V6), appPort)}
		}
	}
	fromProbeAddress := func(f family) netip.Addr { return f.pick(simnode.ProbeV4, simnode.ProbeV6) }
	fromNode := func(f family) netip.Addr { return f.pick(simnode.GatewayV4, simnode.GatewayV6) }
	pins := func() []string {
		var out []string
		for _, pin := range []string{"host_egress", "host_ingress"} {
			if _, err := os.Stat(filepath.Join(bpfobj.PodDir(n.BPFFSDir, a.UID), pin)); err == nil {
				out = append(out, pin)
			}
		}
		return out
	}

	restart(bpfobj.ProbeSNAT)
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs(), Options: podopts.Options{}}); err != nil {
		t.Fatalf("enroll %s: %v", a.Name, err)
	}
	t.Run("snat_reaches_the_app_from_the_probe_address", func(t *testing.T) { probe(t, reached(fromProbeAddress)) })

	n.DropRepliesTo(a, netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fd16:9254:7127:1337::/64"))
	t.Run("snat_fails_where_link_local_replies_are_dropped", func(t *testing.T) { probe(t, failed) })

	restart(bpfobj.ProbeDirect)
	t.Run("direct_after_a_restart_reaches_the_app_from_the_node", func(t *testing.T) {
		probe(t, reached(fromNode))
		if got := pins(); len(got) != 0 {
			t.Errorf("node-side programs left pinned in the direct mode: %v", got)
		}
		for _, f := range nodeSideFilters(t, n, a) {
			if f != "drop_link_local@1" {
				t.Errorf("filter %s left on %s in the direct mode", f, a.HostVeth)
			}
		}
	})

	restart(bpfobj.ProbeSNAT)
	t.Run("snat_again_after_a_restart_translates_again", func(t *testing.T) {
		if got := pins(); len(got) != 2 {
			t.Errorf("node-side programs pinned after the switch back: %v, want host_egress and host_ingress", got)
		}
		probe(t, failed)
	})
	t.Run("probe_entries_go_away", func(t *testing.T) { probeEntriesGoAway(t, n) })
}
