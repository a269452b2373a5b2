// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// Query is a connection for Why to explain, without sending it.
type Query struct {
	// The client: an enrolled pod by namespace/name (FromPod), an address
	// (FromAddr: an enrolled pod's, or a host outside the node), or a
	// local socket of the node such as kubelet's probes (FromNode).
	FromPod  string
	FromAddr netip.Addr
	FromNode bool
	// To is the destination. Port 0 stands for any port but those with
	// rows of their own (53, 15008).
	To netip.AddrPort
	// UDP asks about UDP instead of TCP.
	UDP bool
	// Mark is the client socket's mark (ztunnel's is 0x539, R2).
	Mark uint32
	// Via, with FromPod, is one of the pod's virtual interfaces the
	// connection arrives on (R14: a VM behind the pod).
	Via string
}

// Answer is what Why found: the hooks the connection meets, in order.
type Answer struct {
	From  string         `json:"from"`
	To    netip.AddrPort `json:"to"`
	Proto string         `json:"proto"`
	// Summary names every leg that did more than pass the connection
	// on, or the first leg when all passed.
	Summary string `json:"summary"`
	Legs    []Leg  `json:"legs"`
}

// Leg is one hook's decision, and the checks that led to it.
type Leg struct {
	Pod  string `json:"pod,omitempty"` // whose hook (namespace/name); empty on the node
	Hook Hook   `json:"hook"`
	// Where says where the hook runs, for people ("connect4 in shop/web").
	Where string `json:"where"`
	// Who opened the socket, when not the client itself (ztunnel).
	Who      string         `json:"who,omitempty"`
	Src      netip.AddrPort `json:"src,omitzero"` // zero: not known (an unbound socket, the node)
	Dst      netip.AddrPort `json:"dst"`
	Steps    []Step         `json:"steps"`
	Decision Decision       `json:"decision"`
	Reason   Reason         `json:"reason"`
	Row      string         `json:"row"`
	// To is where a captured connection goes, or a translated probe's
	// new source.
	To netip.AddrPort `json:"redirectedTo,omitzero"`
}

// Step is one check a leg passes through, named by its contract row.
type Step struct {
	Row   string `json:"row"`
	Check string `json:"check"`
	// Result is "continue" or the leg's decision.
	Result string `json:"result"`
}

// ErrUnknownPod is returned by Why for a pod that is not enrolled here.
var ErrUnknownPod = errors.New("no such pod is enrolled on this node")

// nodeConfig is ae_node_cfg as Why needs it.
type nodeConfig struct {
	mark, mask                  uint32
	outbound, inbound, hbone    uint16
	dns                         uint16
	probe4, probe6              netip.Addr
	skLookupInbound, reuseport  bool
	netnsCookieSockops, sockopt bool
	probes                      bpfobj.ProbeMode
}

func readNodeConfig(m *bpfobj.SockMaps) nodeConfig {
	var c bpfobj.SockAeConfig
	if err := m.AeNodeCfg.Lookup(uint32(0), &c); err != nil || c.OutboundPort == 0 {
		// Pins of an agent that did not write it: the contract's defaults.
		c = bpfobj.DefaultConfig(bpfobj.DefaultProbeV4, bpfobj.DefaultProbeV6)
		c.Flags = bpfobj.CfgSkLookupIfindex | bpfobj.CfgNetnsCookieSockops | bpfobj.CfgNetnsCookieSockopt
	}
	return nodeConfig{
		mark: c.ZtunnelMark, mask: c.MarkMask, outbound: c.OutboundPort, inbound: c.InboundPort, hbone: c.HbonePort, dns: c.DnsPort,
		probe4: bpfobj.Addr(c.ProbeV4), probe6: netip.AddrFrom16(c.ProbeV6.B),
		skLookupInbound: c.Flags&bpfobj.CfgSkLookupIfindex != 0, reuseport: c.Flags&bpfobj.CfgSkAssignReuseport != 0,
		netnsCookieSockops: c.Flags&bpfobj.CfgNetnsCookieSockops != 0, sockopt: c.Flags&bpfobj.CfgNetnsCookieSockopt != 0,
		probes: bpfobj.ProbeModeOf(c.Flags),
	}
}

// ProbeMode is the host-probe mode the pinned programs run in (ae_node_cfg).
func (p *Pinned) ProbeMode() bpfobj.ProbeMode { return readNodeConfig(&p.maps).probes }

// why holds what the pins say, for one answer.
type why struct {
	cfg       nodeConfig
	byName    map[string]*PodRecord
	byIP      map[netip.Addr]*PodRecord
	listening map[uint64]bool // netns cookies with ztunnel's :15006 filed
}

// Why answers what the data path would do with a connection, from the
// pinned maps and each pod's options: every hook it meets (the client's
// socket hooks, the node side of the destination pod's veth, the pod's
// sk_lookup, ztunnel's own connections), each decision and the checks
// before it, in the order the programs make them.
func (p *Pinned) Why(q Query) (*Answer, error) {
	pods, err := ReadPods(&p.maps)
	if err != nil {
		return nil, err
	}
	w := &why{cfg: readNodeConfig(&p.maps), byName: map[string]*PodRecord{}, byIP: map[netip.Addr]*PodRecord{}, listening: map[uint64]bool{}}
	for _, st := range pods {
		if st.Journal != bpfobj.MetaEnrolled {
			continue
		}
		AddPinnedReroutes(bpfobj.PodDir(p.dir, st.UID), &st.Options) // its virtual interfaces, from its pins
		w.byName[st.Namespace+"/"+st.Name] = st
		for _, ip := range st.IPs {
			if ownsEntry(&p.maps, &st.EnrolledPod, ip) { // as the programs see it: not an address it lost (problem)
				w.byIP[ip] = st
			}
		}
	}
	var (
		key    bpfobj.SockListenerKey
		cookie uint64
	)
	it := p.maps.AeListeners.Iterate()
	for it.Next(&key, &cookie) {
		if key.Port == w.cfg.inbound {
			w.listening[key.NetnsCookie] = true
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read ae_listeners: %w", err)
	}
	return w.answer(q)
}

func (w *why) answer(q Query) (*Answer, error) {
	dst := netip.AddrPortFrom(q.To.Addr().Unmap(), q.To.Port())
	a := &Answer{To: dst, Proto: "tcp"}
	if q.UDP {
		a.Proto = "udp"
	}
	var client *PodRecord
	switch {
	case q.FromPod != "":
		if client = w.byName[q.FromPod]; client == nil {
			return nil, fmt.Errorf("pod %s: %w", q.FromPod, ErrUnknownPod)
		}
		a.From = q.FromPod
	case q.FromNode:
		a.From = "node"
	case q.FromAddr.IsValid():
		a.From = q.FromAddr.String()
		if client = w.byIP[q.FromAddr.Unmap()]; client != nil {
			a.From += " (" + client.Namespace + "/" + client.Name + ")"
		}
	default:
		return nil, errors.New("no client: name a pod, an address or the node")
	}
	if q.Via != "" && (client == nil || q.FromPod == "") {
		return nil, errors.New("--via names a virtual interface of the client pod: give the pod as FROM")
	}
	switch {
	case q.Via != "":
		if !slices.Contains(client.Options.RerouteInterfaces, q.Via) {
			return nil, fmt.Errorf("pod %s: %s is not one of its virtual interfaces (istio.io/reroute-virtual-interfaces: %q)",
				q.FromPod, q.Via, strings.Join(client.Options.RerouteInterfaces, ","))
		}
		a.From = q.FromPod + " via " + q.Via
		a.Legs = w.fromVirtual(client, dst, q)
	case client != nil:
		a.Legs = w.fromPod(client, dst, q)
	case q.FromNode:
		a.Legs = append([]Leg{w.nodeSocket(dst)}, w.arrive(netip.Addr{}, dst, q.UDP, true)...)
	default:
		a.Legs = w.arrive(q.FromAddr.Unmap(), dst, q.UDP, false)
	}
	a.Summary = summary(a.Legs)
	return a, nil
}

func summary(legs []Leg) string {
	var parts []string
	for _, l := range legs {
		if l.Decision != DecisionPassed && l.Pod != "" {
			parts = append(parts, fmt.Sprintf("%s in %s (%s: %s)", l.Decision, l.Pod, l.Row, l.Reason.Text()))
		}
	}
	if i := slices.IndexFunc(legs, func(l Leg) bool { return l.Pod != "" }); len(parts) == 0 && i >= 0 {
		l := legs[i]
		parts = append(parts, fmt.Sprintf("%s in %s (%s: %s)", l.Decision, l.Pod, l.Row, l.Reason.Text()))
	}
	if len(parts) == 0 {
		return "no program meets it: neither end is an enrolled pod (R16, H3)"
	}
	return strings.Join(parts, "; ")
}

// fromPod follows a connection an enrolled pod's app opens.
func (w *why) fromPod(p *PodRecord, dst netip.AddrPort, q Query) []Leg {
	out := w.outbound(p, dst, q.UDP, q.Mark, "")
	legs := []Leg{out}
	self := podAddr(p, dst.Addr().Is4())
	switch out.Reason {
	case ReasonOutbound:
		// The redirected SYN reaches ztunnel's :15001 over lo; the pod's
		// sk_lookup sees it from the pod's own address and leaves it.
		if w.cfg.skLookupInbound && self.IsValid() {
			legs = append(legs, w.inbound(p, self, out.To, false, false))
		}
		// ztunnel connects on, with its mark, from the pod's address.
		legs = append(legs, w.outbound(p, dst, false, w.cfg.mark, "ztunnel"))
		legs = append(legs, w.arrive(self, dst, false, false)...)
	case ReasonDNS:
		// ztunnel's proxy answers from its own socket (R2), as it asks
		// upstream for names it does not know.
		if q.UDP && self.IsValid() {
			legs = append(legs, w.outbound(p, netip.AddrPortFrom(self, 0), true, w.cfg.mark, "ztunnel's DNS proxy"))
		}
	case ReasonOwnIP:
		if !q.UDP && w.cfg.skLookupInbound {
			legs = append(legs, w.inbound(p, self, dst, false, false))
		}
	case ReasonLoopback:
	default:
		legs = append(legs, w.arrive(self, dst, q.UDP, false)...)
	}
	return legs
}

// fromVirtual follows TCP from behind one of the pod's virtual interfaces
// (R14): captured on arrival, then ztunnel connects on from the pod.
func (w *why) fromVirtual(p *PodRecord, dst netip.AddrPort, q Query) []Leg {
	l := &leg{Leg{Pod: podName(p), Hook: HookReroute, Where: "tc ingress on " + q.Via + " in " + podName(p), Dst: dst}}
	if q.UDP {
		return []Leg{l.decide(ReasonNotTCP, netip.AddrPort{}, "UDP from a virtual interface")}
	}
	l.pass("R14", "%s is one of the pod's virtual interfaces (istio.io/reroute-virtual-interfaces)", q.Via)
	legs := []Leg{l.decide(ReasonReroute, netip.AddrPortFrom(dst.Addr(), w.cfg.outbound), "a new TCP flow from the virtual interface")}
	self := podAddr(p, dst.Addr().Is4())
	legs = append(legs, w.outbound(p, dst, false, w.cfg.mark, "ztunnel"))
	return append(legs, w.arrive(self, dst, false, false)...)
}

// arrive follows a connection from outside the destination pod's netns to
// it: the node side of its veth, then its inbound hook, then ztunnel's
// delivery to the app. Nothing meets a pod that is not enrolled (H3), nor
// UDP (R11).
func (w *why) arrive(src netip.Addr, dst netip.AddrPort, udp, local bool) []Leg {
	p := w.byIP[dst.Addr()]
	if p == nil || udp {
		return nil
	}
	var legs []Leg
	if w.cfg.probes == bpfobj.ProbeSNAT {
		host := w.hostEgress(p, src, dst, local)
		if host.Decision == DecisionTranslated {
			src = host.To.Addr()
		}
		legs = append(legs, host)
	}
	in := w.inbound(p, src, dst, false, local && w.cfg.probes == bpfobj.ProbeDirect)
	legs = append(legs, in)
	if in.Reason == ReasonInbound {
		// ztunnel delivers to the app from the client's address (R10).
		del := w.outbound(p, dst, false, w.cfg.mark, "ztunnel")
		del.Src = netip.AddrPortFrom(src, 0)
		legs = append(legs, del)
		if w.cfg.skLookupInbound {
			legs = append(legs, w.inbound(p, src, dst, true, false))
		}
	}
	return legs
}

// podAddr is the pod's address of a family (ae_netns keeps one each).
func podAddr(p *PodRecord, v4 bool) netip.Addr {
	for _, ip := range p.IPs {
		if ip.Is4() == v4 {
			return ip
		}
	}
	return netip.Addr{}
}

func podName(p *PodRecord) string { return p.Namespace + "/" + p.Name }

// leg builds a Leg step by step.
type leg struct{ Leg }

func (l *leg) pass(row, format string, args ...any) {
	l.Steps = append(l.Steps, Step{Row: row, Check: fmt.Sprintf(format, args...), Result: "continue"})
}

func (l *leg) decide(r Reason, to netip.AddrPort, format string, args ...any) Leg {
	l.Decision, l.Reason, l.Row, l.To = r.Decision(), r, r.Row(), to
	l.Steps = append(l.Steps, Step{Row: r.Row(), Check: fmt.Sprintf(format, args...), Result: r.Decision().String() + ": " + r.Text()})
	return l.Leg
}

func portText(port uint16) string {
	if port == 0 {
		return "any port"
	}
	return fmt.Sprintf("port %d", port)
}

// outbound is classify() in bpf/sock.c: the connect and sendmsg hooks of
// the pod's netns. who names the socket's owner when not the app.
func (w *why) outbound(p *PodRecord, dst netip.AddrPort, udp bool, mark uint32, who string) Leg {
	v4 := dst.Addr().Is4()
	l := &leg{Leg{Pod: podName(p), Hook: HookConnect6, Who: who, Dst: dst}}
	if v4 {
		l.Hook = HookConnect4
	}
	l.Where = l.Hook.String() + " in " + l.Pod
	if udp {
		l.Where = l.Hook.String() + " or sendmsg" + l.Hook.String()[len("connect"):] + " in " + l.Pod
	}
	self := podAddr(p, v4)
	if self.IsValid() {
		l.Src = netip.AddrPortFrom(self, 0)
	}
	l.pass("R16", "%s is enrolled (netns cookie %d)", l.Pod, p.NetnsCookie)
	if mark&w.cfg.mask == w.cfg.mark {
		return l.decide(ReasonZtunnelMark, netip.AddrPort{}, "the socket's mark %#x is ztunnel's", mark)
	}
	l.pass("R2", "the socket's mark %#x is not ztunnel's %#x", mark, w.cfg.mark)
	if dst.Addr().IsLoopback() {
		return l.decide(ReasonLoopback, netip.AddrPort{}, "%s is a loopback address", dst.Addr())
	}
	l.pass("R3", "%s is not a loopback address", dst.Addr())
	if dst.Addr() == self {
		return l.decide(ReasonOwnIP, netip.AddrPort{}, "%s is the pod's own address", dst.Addr())
	}
	l.pass("R4", "%s is not the pod's own address", dst.Addr())
	dns := dst.Port() == 53 && p.Options.DNSCapture
	loopback := netip.IPv6Loopback()
	if v4 {
		loopback = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	}
	if udp {
		switch {
		case dns:
			return l.decide(ReasonDNS, netip.AddrPortFrom(loopback, w.cfg.dns), "UDP to port 53 with DNS capture on")
		case dst.Port() == 53:
			return l.decide(ReasonDNSCaptureOff, netip.AddrPort{}, "UDP to port 53, but DNS capture is off for the pod")
		}
		return l.decide(ReasonUDPNotDNS, netip.AddrPort{}, "UDP to %s, not DNS", portText(dst.Port()))
	}
	probe := w.cfg.probe6
	if v4 {
		probe = w.cfg.probe4
	}
	if dst.Addr() == probe {
		return l.decide(ReasonProbeDest, netip.AddrPort{}, "%s is the host-probe address", dst.Addr())
	}
	l.pass("R8", "%s is not the host-probe address %s", dst.Addr(), probe)
	if dns {
		return l.decide(ReasonDNS, netip.AddrPortFrom(loopback, w.cfg.dns), "TCP to port 53 with DNS capture on")
	}
	switch {
	case dst.Port() == 53:
		l.pass("R13", "DNS capture is off for the pod")
	case dst.Port() == 0:
		l.pass("R9", "any port but DNS (53)")
	default:
		l.pass("R9", "port %d is not DNS (53)", dst.Port())
	}
	to := self
	if !to.IsValid() {
		to = loopback // a pod without an address of the family
	}
	return l.decide(ReasonOutbound, netip.AddrPortFrom(to, w.cfg.outbound), "outbound TCP from the app")
}

// inbound is capture_inbound_lookup() in bpf/tc.c (the pod's sk_lookup;
// before Linux 5.17 capture_inbound() on the pod's interface, which meets
// no traffic from inside the pod). delivery: the flow is one of
// ztunnel's deliveries to the app (filed in ae_local_flows).
//
// nodeProbe: the flow is a node socket's, filed as it connected (H1 in
// direct mode).
func (w *why) inbound(p *PodRecord, src netip.Addr, dst netip.AddrPort, delivery, nodeProbe bool) Leg {
	l := &leg{Leg{Pod: podName(p), Hook: HookSkLookup, Src: netip.AddrPortFrom(src, 0), Dst: dst}}
	l.Where = "sk_lookup in " + l.Pod
	if !w.cfg.skLookupInbound {
		l.Hook, l.Where = HookTCIngress, "tc ingress on "+p.Interface+" in "+l.Pod
	}
	if !src.IsValid() {
		l.Src = netip.AddrPort{}
	}
	l.pass("R16", "%s is %s's address, arriving on %s", dst.Addr(), l.Pod, p.Interface)
	if p.Options.BypassInbound {
		return l.decide(ReasonIngressMode, netip.AddrPort{}, "the pod is in ingress mode (ambient.istio.io/bypass-inbound-capture)")
	}
	l.pass("R12", "inbound capture is on for the pod")
	if dst.Port() == w.cfg.hbone {
		return l.decide(ReasonHBONE, netip.AddrPort{}, "port %d is ztunnel's HBONE port", dst.Port())
	}
	l.pass("R6", "%s is not ztunnel's HBONE port %d", portText(dst.Port()), w.cfg.hbone)
	if w.cfg.skLookupInbound {
		if src == dst.Addr() {
			return l.decide(ReasonFromPod, netip.AddrPort{}, "from the pod's own address, over lo")
		}
		l.pass("R4", "from outside the pod")
		if delivery {
			return l.decide(ReasonZtunnelDelivery, netip.AddrPort{}, "ztunnel's connection to the app, filed in ae_local_flows")
		}
		l.pass("R10", "not one of ztunnel's deliveries to the app")
	}
	switch {
	case w.cfg.probes == bpfobj.ProbeDirect:
		l.pass("R7", "direct mode: the host-probe address is an ordinary source")
	case src.IsValid() && (src == w.cfg.probe4 || src == w.cfg.probe6):
		return l.decide(ReasonProbeSource, netip.AddrPort{}, "from the host-probe address %s", src)
	default:
		l.pass("R7", "not from the host-probe address")
	}
	if nodeProbe {
		return l.decide(ReasonProbeDirect, netip.AddrPort{}, "the flow a socket of the node filed as it connected (ae_probe_nat)")
	}
	if w.cfg.probes == bpfobj.ProbeDirect {
		l.pass("H1", "no socket of the node filed this flow")
	}
	if w.cfg.skLookupInbound && !w.listening[p.NetnsCookie] {
		return l.decide(ReasonNoListener, netip.AddrPort{}, "no ztunnel :%d listener is filed for the pod's netns (ae_listeners)", w.cfg.inbound)
	}
	if !w.cfg.skLookupInbound {
		// tc looks the listener up in the pod's netns; so does this.
		switch ok, err := tcpListening(p.NetnsPath, w.cfg.inbound); {
		case err != nil:
			l.pass("R5", "whether ztunnel listens on :%d in the pod's netns is not known: %v", w.cfg.inbound, err)
		case !ok:
			return l.decide(ReasonNoListener, netip.AddrPort{}, "nothing listens on :%d in the pod's netns", w.cfg.inbound)
		default:
			l.pass("R5", "ztunnel listens on :%d in the pod's netns", w.cfg.inbound)
		}
	}
	return l.decide(ReasonInbound, netip.AddrPortFrom(dst.Addr(), w.cfg.inbound), "a new inbound TCP flow")
}

// nodeSocket is the node's own socket meeting the connect hooks (they are
// attached to the cgroup root, above every process of the node): its netns
// is no pod's.
func (w *why) nodeSocket(dst netip.AddrPort) Leg {
	l := &leg{Leg{Hook: HookConnect6, Dst: dst}}
	if dst.Addr().Is4() {
		l.Hook = HookConnect4
	}
	l.Where = l.Hook.String() + " on the node"
	if p := w.byIP[dst.Addr()]; p != nil && w.cfg.probes == bpfobj.ProbeDirect {
		l.pass("H1", "direct mode: a TCP socket of the node's netns connecting to %s is marked; sockops files its flow before the SYN leaves", podName(p))
	}
	return l.decide(ReasonNotEnrolled, netip.AddrPort{}, "the node's netns is no enrolled pod's")
}

// hostEgress is snat_probe() in bpf/tc.c, on the node side of the pod's
// veth. local: the client is a socket of the node (kubelet's probes).
func (w *why) hostEgress(p *PodRecord, src netip.Addr, dst netip.AddrPort, local bool) Leg {
	l := &leg{Leg{Pod: podName(p), Hook: HookHostEgress, Dst: dst, Where: "tc egress on " + p.HostInterface + ", the node side of " + podName(p)}}
	if src.IsValid() {
		l.Src = netip.AddrPortFrom(src, 0)
	}
	if !local {
		return l.decide(ReasonForwarded, netip.AddrPort{}, "no local socket: forwarded through the node (NodePort, another pod, outside)")
	}
	l.pass("H3", "%s is an enrolled pod's address", dst.Addr())
	probe := w.cfg.probe6
	if dst.Addr().Is4() {
		probe = w.cfg.probe4
	}
	return l.decide(ReasonProbeSNAT, netip.AddrPortFrom(probe, 0), "a local socket of the node (kubelet's probe): its source becomes %s", probe)
}

// tcpListening reports whether a TCP socket listens on port in the netns
// at path, from /proc/thread-self/net/tcp{,6} read inside it.
func tcpListening(path string, port uint16) (bool, error) {
	if path == "" {
		return false, errors.New("the pod's netns is not known")
	}
	found := false
	err := nsexec.Do(path, func() error {
		for _, f := range []string{"/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			for _, line := range strings.Split(string(b), "\n")[1:] {
				// sl local_address rem_address st ...: "ADDR:PORT" in hex, st 0A is LISTEN.
				fields := strings.Fields(line)
				if len(fields) < 4 || fields[3] != "0A" {
					continue
				}
				_, hexPort, _ := strings.Cut(fields[1], ":")
				if p, err := strconv.ParseUint(hexPort, 16, 16); err == nil && uint16(p) == port {
					found = true
				}
			}
		}
		return nil
	})
	return found, err
}
