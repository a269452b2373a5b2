// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package conformance runs every row of the ambient contract's section 2
// against real traffic on a simulated node, on ambient-ebpf's eBPF data
// path (with and without the sockmap acceleration), on the iptables in-pod
// rules istio-cni applies (test/reference) and, built with the
// istiocnireal tag as make test builds it, on the real istio-cni, and
// requires identical outcomes. Test names carry backend, row and family:
// TestConformance/ebpf/R1_outbound_tcp_v4.
package conformance

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"reflect"
	"strconv"
	"strings"
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

// env is one node with a ztunnel stand-in and these pods:
//
//	a  enrolled, DNS capture on      b  enrolled, DNS capture on
//	c  not enrolled                  d  enrolled in ingress mode, DNS capture off (R12, R13)
//	e  enrolled with a virtual interface leading to a VM (R14)
//
// plus an outside host (TCP, UDP and DNS servers) and a node-level app in
// kubelet's position.
type env struct {
	node          *simnode.Node
	b             backend
	a, bpod, c, d *simnode.Pod
	e             *simnode.Pod
	vm            *simnode.VM
	appA, appB    *simnode.App
	appC, appD    *simnode.App
	appVM         *simnode.App
	outside       *simnode.App
	host          *simnode.App
	zt            *simnode.Ztunnel
}

func newEnv(t *testing.T, b backend) *env {
	n := simnode.New(t)
	e := &env{node: n, b: b}
	e.a, e.bpod, e.c, e.d, e.e = n.AddPod("a"), n.AddPod("b"), n.AddPod("c"), n.AddPod("d"), n.AddPod("e")
	e.vm = n.AddVirtualInterface(e.e, "virt0")
	b.setup(t, n)
	if ab, ok := b.(agentBackend); ok {
		e.zt = ab.startZtunnel(t, n)
	} else {
		e.zt = n.StartZtunnel()
	}
	if w, ok := b.(ztunnelWatcher); ok {
		w.ztunnelStarted(t, n)
	}
	enroll := func(p *simnode.Pod, o podOpts) {
		e.handToZtunnel(p)
		b.enroll(t, p, o)
	}
	enroll(e.a, podOpts{dns: true})
	enroll(e.bpod, podOpts{dns: true})
	enroll(e.d, podOpts{ingressMode: true})
	enroll(e.e, podOpts{dns: true, reroute: []string{"virt0"}})

	any6 := netip.IPv6Unspecified()
	listen := func(p *simnode.Pod, name string) *simnode.App {
		app := n.StartApp(p)
		app.Listen("tcp", name, netip.AddrPortFrom(any6, appPort))
		return app
	}
	e.appA, e.appB, e.appC, e.appD = listen(e.a, "a"), listen(e.bpod, "b"), listen(e.c, "c"), listen(e.d, "d")
	e.appA.Listen("tcp", "a-lo", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), loPort))
	e.appA.Listen("tcp", "a-lo", netip.AddrPortFrom(netip.IPv6Loopback(), loPort))
	e.appVM = n.StartVMApp(e.vm)
	e.outside = n.StartOutsideApp()
	e.outside.Listen("tcp", "outside", netip.AddrPortFrom(any6, appPort))
	e.outside.Listen("udp", "outside-udp", netip.AddrPortFrom(any6, udpPort))
	if _, err := e.outside.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(any6, 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		t.Fatalf("outside dns server: %v", err)
	}
	e.host = n.StartNodeApp()
	e.host.Listen("tcp", "node", netip.AddrPortFrom(simnode.ProbeV4, nodePort))
	e.host.Listen("tcp", "node", netip.AddrPortFrom(simnode.ProbeV6, nodePort))
	return e
}

// handToZtunnel gives the stand-in the pod's netns, where the test is
// its ZDS server; a node agent's backend (agentBackend) hands it pods
// itself.
func (e *env) handToZtunnel(p *simnode.Pod) {
	if _, ok := e.b.(agentBackend); !ok {
		e.zt.Add(p)
	}
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
	// DNS: the address answered, and where the app saw the reply come from.
	Answer    netip.Addr     `json:"answer,omitzero"`
	ReplyFrom netip.AddrPort `json:"replyFrom,omitzero"`
	// Summary of a many-connection scenario.
	Summary string `json:"summary,omitempty"`
}

// ZtunnelSaw is the stand-in's view of a captured connection.
type ZtunnelSaw struct {
	Listener int            `json:"listener"`
	OrigDst  netip.AddrPort `json:"origDst,omitzero"`
	// For DNS: the client address ztunnel saw and whether it asked upstream.
	Peer        netip.Addr `json:"peer,omitzero"`
	DNSUpstream bool       `json:"dnsUpstream,omitempty"`
	// How the original destination was learned; checked for outbound
	// (R1 requires SO_ORIGINAL_DST), where inbound may use either.
	From string `json:"from,omitempty"`
}

func (e *env) observe(resp simnode.AppResponse, err error) Outcome {
	if err != nil {
		return Outcome{Err: "failed"}
	}
	o := Outcome{Server: resp.Reply.Server, ServerPeer: resp.Reply.Peer.Addr(), ServerAddr: resp.Reply.Local}
	// This connection's record, not one of an earlier connection from the
	// same client port (to another pod, in another row).
	if r, ok := e.zt.RecordSince(resp.Local, resp.Start); ok {
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
			// a's ztunnel dials from a's address; b's keeps it (R10).
			return got, Outcome{Server: "b", ServerPeer: f.pick(e.a.V4, e.a.V6), ServerAddr: dst,
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
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.InboundPort, OrigDst: dst}}
		}},
		{"R5_inbound_tuple_reused_over_time_wait", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			// The server side closes first, so ztunnel's accepted socket
			// stays in TIME_WAIT; the client comes back from the same port.
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			src := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), simnode.FixedClientPort+uint16(len(f)))
			req := simnode.AppRequest{Addr: dst, Bind: src, WaitEOF: true}
			if _, err := e.outside.Dial("tcp", req); err != nil {
				return Outcome{Err: "first connection: " + err.Error()}, Outcome{}
			}
			if !timeWaitIn(t, e.a, src) {
				t.Errorf("no TIME_WAIT socket for %s in pod a: the scenario did not set up its condition", src)
			}
			got := e.observe(e.outside.Dial("tcp", req))
			return got, Outcome{Server: "a", ServerPeer: src.Addr(), ServerAddr: dst,
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
		{"R9_dns_udp", allFamilies, dnsScenario("udp", false, "r9-udp", true)},
		{"R9_dns_udp_connected", allFamilies, dnsScenario("udp", true, "r9-udpc", true)},
		{"R9_dns_tcp", allFamilies, dnsScenario("tcp", false, "r9-tcp", true)},
		{"R9_dns_upstream_query_untouched", allFamilies, dnsScenario("udp", false, "r9-up", false)},
		{"R10_original_source_return_path", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			// The app sees the client's own address and its reply reaches
			// the client through ztunnel.
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.InboundPort, OrigDst: dst}}
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
		{"R12_ingress_mode_inbound_direct", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.d.V4, e.d.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "d", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst}
		}},
		{"R12_ingress_mode_outbound_captured", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), appPort)
			got := e.observe(e.appD.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "outside", ServerPeer: f.pick(e.d.V4, e.d.V6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.OutboundPort, OrigDst: dst, From: "SO_ORIGINAL_DST"}}
		}},
		{"R13_dns_capture_off", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			server := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), 53)
			name := fmt.Sprintf("r13-%s.%s", f, simnode.KnownDNSSuffix)
			got := e.observeDNS(e.appD.Do(simnode.AppRequest{Op: "dns", Addr: server, DNSName: name, Proto: "udp"}))
			return got, Outcome{Answer: simnode.OutsideDNSAnswer, ReplyFrom: server}
		}},
		{"R14_virtual_interface_outbound", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), appPort)
			resp, err := e.appVM.Dial("tcp", simnode.AppRequest{Addr: dst})
			got := e.observe(resp, err)
			// The VM's connection is the pod's outbound traffic: ztunnel
			// carries it from the pod's address.
			return got, Outcome{Server: "outside", ServerPeer: f.pick(e.e.V4, e.e.V6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.OutboundPort, OrigDst: dst, From: "SO_ORIGINAL_DST"}}
		}},
		{"H1_host_probe_snat", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.ProbeV4, simnode.ProbeV6), ServerAddr: dst}
		}},
		{"H1_host_probe_snat_ingress_mode", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.d.V4, e.d.V6), appPort)
			got := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "d", ServerPeer: f.pick(simnode.ProbeV4, simnode.ProbeV6), ServerAddr: dst}
		}},
		{"H2_forwarded_not_snat_captured", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.outside.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.OutsideV4, simnode.OutsideV6), ServerAddr: dst,
				Ztunnel: &ZtunnelSaw{Listener: standin.InboundPort, OrigDst: dst}}
		}},
		{"H3_pod_outside_mesh_untouched", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.c.V4, e.c.V6), appPort)
			got := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "c", ServerPeer: f.pick(simnode.GatewayV4, simnode.GatewayV6), ServerAddr: dst}
		}},
		{"H1_H2_200_probes_200_forwarded_at_once", []family{v4}, concurrentProbes},
	}
}

// dnsScenario queries the outside host's address for a name; known names
// are answered by ztunnel's proxy, others by the outside server (through
// ztunnel's own upstream query, which must not be captured again).
func dnsScenario(proto string, connected bool, label string, known bool) func(*testing.T, *env, family) (Outcome, Outcome) {
	return func(t *testing.T, e *env, f family) (Outcome, Outcome) {
		server := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), 53)
		name := fmt.Sprintf("%s-%s.example.test", label, f)
		answer := simnode.OutsideDNSAnswer
		if known {
			name = fmt.Sprintf("%s-%s.%s", label, f, simnode.KnownDNSSuffix)
			answer = simnode.KnownDNSAnswer
		}
		got := e.observeDNS(e.appA.Do(simnode.AppRequest{Op: "dns", Addr: server, DNSName: name, Proto: proto, Connected: connected}))
		for _, r := range e.zt.Records() {
			if r.DNSName == name+"." {
				got.Ztunnel = &ZtunnelSaw{Listener: r.Listener, Peer: r.Peer.Addr(), DNSUpstream: r.DNSUpstream}
			}
		}
		return got, Outcome{Answer: answer, ReplyFrom: server,
			Ztunnel: &ZtunnelSaw{Listener: standin.DNSPort, Peer: f.pick(e.a.V4, e.a.V6), DNSUpstream: !known}}
	}
}

// concurrentProbes holds 200 kubelet-style probes and 200 forwarded
// connections open against the same pod at once: every probe must be
// translated and no forwarded connection may be.
func concurrentProbes(t *testing.T, e *env, f family) (Outcome, Outcome) {
	const n = 200
	dst := netip.AddrPortFrom(e.a.V4, appPort)
	var probes, forwarded simnode.AppResponse
	var perr, ferr error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		probes, perr = e.host.Do(simnode.AppRequest{Op: "dial-many", Addr: dst, Count: n})
	}()
	go func() {
		defer wg.Done()
		forwarded, ferr = e.outside.Do(simnode.AppRequest{Op: "dial-many", Addr: dst, Count: n})
	}()
	wg.Wait()
	if perr != nil || ferr != nil {
		return Outcome{Err: fmt.Sprint(perr, ferr)}, Outcome{}
	}
	count := func(rs []simnode.DialResult, peer netip.Addr) (ok, matching int) {
		for _, r := range rs {
			if r.Err == "" && r.Reply != nil {
				ok++
				if r.Reply.Peer.Addr() == peer {
					matching++
				}
			}
		}
		return ok, matching
	}
	pOK, pSNAT := count(probes.Replies, simnode.ProbeV4)
	fOK, fSNAT := count(forwarded.Replies, simnode.ProbeV4)
	_, fOrig := count(forwarded.Replies, simnode.OutsideV4)
	got := Outcome{Summary: fmt.Sprintf("probes %d ok %d snat; forwarded %d ok %d snat %d original source", pOK, pSNAT, fOK, fSNAT, fOrig)}
	return got, Outcome{Summary: fmt.Sprintf("probes %d ok %d snat; forwarded %d ok %d snat %d original source", n, n, n, 0, n)}
}

// timeWaitIn reports whether the pod holds a TIME_WAIT socket whose peer is
// peer, from /proc/net/tcp{,6} read inside the pod's netns (no ss in the
// kernel-matrix guests).
func timeWaitIn(t *testing.T, p *simnode.Pod, peer netip.AddrPort) bool {
	found := false
	err := simnode.InNetns(p.NS, func() error {
		for _, file := range []string{"/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"} {
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			for _, line := range strings.Split(string(b), "\n")[1:] {
				f := strings.Fields(line)
				if len(f) < 4 || f[3] != "06" { // TCP_TIME_WAIT
					continue
				}
				if ap, ok := procNetAddr(f[2]); ok && ap.Addr().Unmap() == peer.Addr() && ap.Port() == peer.Port() {
					found = true
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("read sockets of pod %s: %v", p.Name, err)
	}
	return found
}

// procNetAddr decodes /proc/net/tcp's "ADDR:PORT": the address as 32-bit
// words in host byte order, the port in hex.
func procNetAddr(s string) (netip.AddrPort, bool) {
	addr, port, ok := strings.Cut(s, ":")
	raw, err := hex.DecodeString(addr)
	if !ok || err != nil || (len(raw) != 4 && len(raw) != 16) {
		return netip.AddrPort{}, false
	}
	for i := 0; i < len(raw); i += 4 {
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	a, _ := netip.AddrFromSlice(raw)
	pn, err := strconv.ParseUint(port, 16, 16)
	if err != nil {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(a, uint16(pn)), true
}

func (e *env) observeDNS(resp simnode.AppResponse, err error) Outcome {
	if err != nil {
		return Outcome{Err: "failed: " + err.Error()}
	}
	return Outcome{Answer: resp.Answer, ReplyFrom: resp.From}
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
		{"R16_removed_pod_probe_not_snat", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			dst := netip.AddrPortFrom(f.pick(e.a.V4, e.a.V6), appPort)
			got := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst}))
			return got, Outcome{Server: "a", ServerPeer: f.pick(simnode.GatewayV4, simnode.GatewayV6), ServerAddr: dst}
		}},
		{"R16_removed_pod_dns_direct", allFamilies, func(t *testing.T, e *env, f family) (Outcome, Outcome) {
			server := netip.AddrPortFrom(f.pick(simnode.OutsideV4, simnode.OutsideV6), 53)
			name := fmt.Sprintf("r16-%s.%s", f, simnode.KnownDNSSuffix)
			got := e.observeDNS(e.appA.Do(simnode.AppRequest{Op: "dns", Addr: server, DNSName: name, Proto: "udp"}))
			return got, Outcome{Answer: simnode.OutsideDNSAnswer, ReplyFrom: server}
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

// ipReuse: pod f is enrolled, then goes away without a removal; pod g gets
// f's addresses and is enrolled; f's late removal must leave g's probe
// translation (the node's set of enrolled pod IPs) alone.
func ipReuse(t *testing.T, e *env) (Outcome, Outcome) {
	old := e.node.AddPod("f")
	e.b.enroll(t, old, podOpts{})
	e.node.DeletePodNetwork(old)
	cur := e.node.AddPodWithAddrs("g", old.V4, old.V6)
	app := e.node.StartApp(cur)
	app.Listen("tcp", "g", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	e.handToZtunnel(cur)
	e.b.enroll(t, cur, podOpts{})
	e.b.remove(t, old)
	// Both families: the probe to g is still translated.
	var got, want []string
	for _, ip := range []netip.Addr{cur.V4, cur.V6} {
		dst := netip.AddrPortFrom(ip, appPort)
		o := e.observe(e.host.Dial("tcp", simnode.AppRequest{Addr: dst}))
		got = append(got, js(o))
		probe := simnode.ProbeV4
		if ip.Is6() {
			probe = simnode.ProbeV6
		}
		want = append(want, js(Outcome{Server: "g", ServerPeer: probe, ServerAddr: dst}))
	}
	return Outcome{Summary: strings.Join(got, " ")}, Outcome{Summary: strings.Join(want, " ")}
}

func js(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestConformance(t *testing.T) {
	seen := &outcomes{got: map[string]map[string]Outcome{}}
	var ran []backend // a backend a -test.skip pattern leaves out is not compared
	for _, b := range backends() {
		t.Run(b.name(), func(t *testing.T) {
			ran = append(ran, b)
			e := newEnv(t, b)
			if eb, ok := b.(*ebpfBackend); ok {
				if eb.accel.On() {
					defer t.Run("sockmap_accelerated_the_hops", func(t *testing.T) { checkAccelerated(t, eb.dp, e.node) })
				}
				defer t.Run("H1_probe_translations_of_finished_connections_go_away", func(t *testing.T) { probeEntriesGoAway(t, e.node) })
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
			t.Run("H4_ip_reuse_keeps_new_owner_v4_v6", func(t *testing.T) {
				got, want := ipReuse(t, e)
				seen.add(b.name(), "H4_ip_reuse_keeps_new_owner_v4_v6", got)
				if !reflect.DeepEqual(got, want) {
					t.Errorf("outcome differs from the contract\n got: %s\nwant: %s", js(got), js(want))
				}
			})
		})
	}
	t.Run("parity", func(t *testing.T) {
		all, ref := ran, referenceBackend()
		for name, byBackend := range seen.got {
			if len(byBackend) != len(all) {
				t.Errorf("%s ran on %d backends, want %d", name, len(byBackend), len(all))
				continue
			}
			for _, b := range all {
				if got, want := byBackend[b.name()], byBackend[ref]; !reflect.DeepEqual(got, want) {
					t.Errorf("%s: %s and %s differ\n%12s: %s\n%12s: %s", name, b.name(), ref, b.name(), js(got), ref, js(want))
				}
			}
		}
	})
}
