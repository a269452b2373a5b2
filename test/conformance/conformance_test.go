// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package conformance runs every row of the ambient contract's section 2
// on two backends, ambient-ebpf's eBPF data path and the iptables in-pod
// rules istio-cni applies, against real traffic on a simulated node, and
// requires identical outcomes. Test names carry backend, row and family:
// TestConformance/ebpf/R1_outbound_tcp_v4.
package conformance

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"sync"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

func TestMain(m *testing.M) {
	simnode.RunHelper()
	os.Exit(m.Run())
}

const (
	appPort     = 8080
	loPort      = 8081
	nodePort    = 8082
	udpPort     = 9999
	ztunnelMark = 0x539
)

// env is one node with two enrolled pods (a, b), a ztunnel stand-in serving
// them, an outside host and a node-level app (the kubelet's position).
type env struct {
	node    *simnode.Node
	b       backend
	a, bpod *simnode.Pod
	appA    *simnode.App
	appB    *simnode.App
	outside *simnode.App
	host    *simnode.App
	zt      *simnode.Ztunnel
}

func newEnv(t *testing.T, b backend) *env {
	n := simnode.New(t)
	e := &env{node: n, b: b}
	e.a = n.AddPod("a")
	e.bpod = n.AddPod("b")
	b.setup(t, n)
	e.zt = n.StartZtunnel()
	for _, p := range []*simnode.Pod{e.a, e.bpod} {
		e.zt.Add(p)
		b.enroll(t, p)
	}
	any6 := netip.IPv6Unspecified()
	e.appA = n.StartApp(e.a)
	e.appA.Listen("tcp", "a", netip.AddrPortFrom(any6, appPort))
	e.appA.Listen("tcp", "a-lo", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), loPort))
	e.appA.Listen("tcp", "a-lo", netip.AddrPortFrom(netip.IPv6Loopback(), loPort))
	e.appB = n.StartApp(e.bpod)
	e.appB.Listen("tcp", "b", netip.AddrPortFrom(any6, appPort))
	e.outside = n.StartOutsideApp()
	e.outside.Listen("tcp", "outside", netip.AddrPortFrom(any6, appPort))
	e.outside.Listen("udp", "outside-udp", netip.AddrPortFrom(any6, udpPort))
	e.host = n.StartNodeApp()
	e.host.Listen("tcp", "node", netip.AddrPortFrom(simnode.ProbeV4, nodePort))
	e.host.Listen("tcp", "node", netip.AddrPortFrom(simnode.ProbeV6, nodePort))
	return e
}

type family string

const (
	v4       family = "v4"
	v6       family = "v6"
	v4mapped family = "v4mapped"
)

func (f family) pick(a4, a6 netip.Addr) netip.Addr {
	if f == v6 {
		return a6
	}
	return a4
}

// Outcome is what the receiving side saw; it must be the same on both
// backends and equal to the row's expectation.
type Outcome struct {
	Err        string         `json:"err,omitempty"`
	Server     string         `json:"server,omitempty"`
	ServerPeer netip.Addr     `json:"serverPeer,omitzero"`
	ServerAddr netip.AddrPort `json:"serverAddr,omitzero"`
	// Ztunnel is what the stand-in recorded for this connection: nil when
	// the connection did not go through ztunnel.
	Ztunnel *ZtunnelSaw `json:"ztunnel,omitempty"`
}

// ZtunnelSaw is the stand-in's view of a captured connection.
type ZtunnelSaw struct {
	Listener int            `json:"listener"`
	OrigDst  netip.AddrPort `json:"origDst"`
	// How the original destination was learned; checked for outbound
	// (R1 requires SO_ORIGINAL_DST), where inbound may use either.
	From string `json:"from,omitempty"`
}

func (e *env) observe(resp simnode.AppResponse, err error) Outcome {
	if err != nil {
		return Outcome{Err: "failed"}
	}
	o := Outcome{Server: resp.Reply.Server, ServerPeer: resp.Reply.Peer.Addr(), ServerAddr: resp.Reply.Local}
	if r, ok := e.zt.RecordFor(resp.Local); ok {
		o.Ztunnel = saw(r)
	}
	return o
}

func saw(r standin.Record) *ZtunnelSaw {
	s := &ZtunnelSaw{Listener: r.Listener, OrigDst: r.OrigDst}
	if r.Listener == standin.OutboundPort {
		s.From = r.OrigDstFrom
	}
	return s
}

type scenario struct {
	row      string
	families []family
	run      func(t *testing.T, e *env, f family) (got, want Outcome)
}

var allFamilies = []family{v4, v6}

func scenarios() []scenario {
	return []scenario{
		{"R1_outbound_tcp", []family{v4, v6, v4mapped}, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), appPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst, Mapped: f == v4mapped}))
			return got, Outcome{Server: "outside", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.OutboundPort, OrigDst: dst, From: "SO_ORIGINAL_DST"}}
		}},
		{"R1_R5_pod_to_pod", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.bpod.V4, e.bpod.V6), appPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst}))
			// b's ztunnel delivers to b's app from b's own address.
			return got, Outcome{Server: "b", ServerPeer: dst.Addr(), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.OutboundPort, OrigDst: dst, From: "SO_ORIGINAL_DST"}}
		}},
		{"R2_ztunnel_marked_outbound", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), appPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst, Mark: ztunnelMark}))
			return got, Outcome{Server: "outside", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: dst}
		}},
		{"R3_loopback_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()), loPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a-lo", ServerPeer: dst.Addr(), ServerAddr: dst}
		}},
		{"R4_own_pod_ip_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: dst.Addr(), ServerAddr: dst}
		}},
		{"R5_inbound_tcp", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: dst.Addr(), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.InboundPort, OrigDst: dst}}
		}},
		{"R6_hbone_port_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), standin.HBONEPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "ztunnel-hbone", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.HBONEPort, OrigDst: dst}}
		}},
		{"R7_probe_source_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			probe := f.pick(simnode.ProbeV4, simnode.ProbeV6)
			got := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst, Bind: netip.AddrPortFrom(probe, 0)}))
			return got, Outcome{Server: "a", ServerPeer: probe, ServerAddr: dst}
		}},
		{"R8_probe_destination_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.ProbeV4, simnode.ProbeV6), nodePort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "node", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: dst}
		}},
		{"R11_udp_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), udpPort)
			got := e.observe(e.appA.Dial("udp", simnode.AppRequest{Addr: dst}))
			// The UDP server answers from its wildcard socket.
			return got, Outcome{Server: "outside-udp", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: netip.AddrPortFrom(netip.IPv6Unspecified(), udpPort)}
		}},
		{"R11_icmp_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := f.pick(simnode.OutsideV4, simnode.OutsideV6)
			err := e.appA.Ping(dst)
			got := Outcome{Server: "echo-reply"}
			if err != nil {
				got = Outcome{Err: err.Error()}
			}
			return got, Outcome{Server: "echo-reply"}
		}},
	}
}

// removalScenarios run after pod a left the mesh (R16).
func removalScenarios() []scenario {
	return []scenario{
		{"R16_removed_pod_outbound_direct", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), appPort)
			got := e.observe(e.appA.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "outside", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: dst}
		}},
		{"R16_removed_pod_inbound_direct", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst}
		}},
	}
}

// outcomes collects what each backend saw, for the parity check.
type outcomes struct {
	mu  sync.Mutex
	got map[string]map[string]Outcome // test name (without backend) -> backend -> outcome
}

func (o *outcomes) add(backend, name string, out Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.got[name] == nil {
		o.got[name] = map[string]Outcome{}
	}
	o.got[name][backend] = out
}

func runScenarios(t *testing.T, e *env, list []scenario, seen *outcomes) {
	for _, sc := range list {
		for _, f := range sc.families {
			name := fmt.Sprintf("%s_%s", sc.row, f)
			t.Run(name, func(t *testing.T) {
				got, want := sc.run(t, e, f)
				seen.add(e.b.name(), name, got)
				if !reflect.DeepEqual(got, want) {
					t.Errorf("outcome differs from the contract\n got: %s\nwant: %s", js(got), js(want))
				}
			})
		}
	}
}

func js(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestConformance(t *testing.T) {
	seen := &outcomes{got: map[string]map[string]Outcome{}}
	for _, b := range backends() {
		t.Run(b.name(), func(t *testing.T) {
			e := newEnv(t, b)
			if b.name() == "ebpf" {
				t.Run("no_iptables_or_nftables_rules", func(t *testing.T) {
					for _, ns := range []string{simnode.NetnsPath(e.node.NodeNS), simnode.NetnsPath(e.node.OutsideNS), e.a.NetnsPath(), e.bpod.NetnsPath()} {
						if rules := rulesIn(t, ns); rules != "" {
							t.Errorf("rules found in %s:\n%s", ns, rules)
						}
					}
				})
			}
			runScenarios(t, e, scenarios(), seen)
			b.remove(t, e.a)
			runScenarios(t, e, removalScenarios(), seen)
		})
	}
	t.Run("parity", func(t *testing.T) {
		for name, byBackend := range seen.got {
			if len(byBackend) != 2 {
				t.Errorf("%s ran on %d backends, want 2", name, len(byBackend))
				continue
			}
			if !reflect.DeepEqual(byBackend["ebpf"], byBackend["iptables"]) {
				t.Errorf("%s: ebpf and iptables differ\n    ebpf: %s\niptables: %s", name, js(byBackend["ebpf"]), js(byBackend["iptables"]))
			}
		}
	})
}
