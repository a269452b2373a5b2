// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package takeover runs the real agent binary on a simulated node that
// istio-cni redirects (its exact rules, applied by test/reference) while
// long-lived streams and a continuous sampler of new connections run
// through the ztunnel stand-in: the agent takes the pods over in place
// (issue 17), and hands them back on uninstall. Nothing may go
// unredirected at any moment, no connection may break, and nobody else's
// rules may change.
package takeover

import (
	"context"
	"fmt"
	"maps"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/ti-mo/conntrack"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

func TestMain(m *testing.M) { agentrun.Main(m) }

// Ports of the suite's servers: echo servers for the streams, reply
// servers for the sampler's connections; in the pods and on the outside
// host alike.
const (
	outsideEchoPort  = 7007
	podEchoPort      = 7008
	outsideReplyPort = 8080
	podReplyPort     = 8081
)

// podSpec describes one pod of a scenario.
type podSpec struct {
	name    string
	backend reference.Backend // the iptables istio-cni wrote the pod's rules with
	// unrelated installs someone else's rules in the pod first.
	unrelated bool
	// edit changes istio-cni's rules after they are applied (a hand edit),
	// nil: none.
	edit func(t *testing.T, p *simnode.Pod)
}

// scenario is a node as istio-cni leaves it: the reference's rules in the
// node and in every pod, the pods handed to the ztunnel stand-in by the
// test (playing istio-cni over ZDS at the path the agent listens on
// later), apps serving and dialing in each pod and on the outside host.
type scenario struct {
	*agentrun.Node
	ref  *reference.Iptables
	zt   *simnode.Ztunnel
	pods []*tpod
	// The outside host's app holding the inbound streams.
	out *simnode.App
}

// tpod is a pod of a scenario: app serves and holds its outbound streams;
// sampler and outSampler (on the outside host) dial the sampler's
// outbound and inbound connections.
type tpod struct {
	*simnode.Pod
	spec                     podSpec
	app, sampler, outSampler *simnode.App
}

// nodeBackend is the iptables of istio-cni's host rule on the scenario
// node: legacy, so that the takeover meets both backends (the hand-back
// writes iptables-nft).
const nodeBackend = reference.Legacy

func newScenario(t *testing.T, specs ...podSpec) *scenario {
	t.Helper()
	s := &scenario{Node: agentrun.New(t, simnode.New(t), agentrun.Options{LogLevel: "debug"})}
	node := simnode.NetnsPath(s.NodeNS)
	installUnrelated(t, node)
	s.ref = &reference.Iptables{Backend: nodeBackend}
	s.ref.Setup(t, s.Node.Node)
	var entries []agentrun.PodEntry
	for _, spec := range specs {
		p := &tpod{Pod: s.AddPod(spec.name), spec: spec}
		if spec.unrelated {
			installUnrelated(t, p.NetnsPath())
		}
		s.ref.WithBackend(spec.backend).Enroll(t, p.Pod, podopts.Options{DNSCapture: true})
		if spec.edit != nil {
			spec.edit(t, p.Pod)
		}
		s.pods = append(s.pods, p)
		// istio-cni wrote the annotation once ztunnel had the pod.
		entries = append(entries, agentrun.PodEntry{Pod: p.Pod, StatusIPs: true,
			Annotations: map[string]string{"ambient.istio.io/redirection": "enabled"}})
	}
	if err := os.WriteFile(s.PodFile, []byte(agentrun.PodFile(entries...)), 0o644); err != nil {
		t.Fatal(err)
	}
	s.zt = s.StartZtunnelServedAt(s.ZDS)
	for _, p := range s.pods {
		s.zt.Add(p.Pod)
	}
	s.startApps(t)
	return s
}

// startApps starts each pod's apps (in the pod's cgroup: the agent finds
// the pod's netns through them too) and the outside host's, serving the
// echo and reply ports.
func (s *scenario) startApps(t *testing.T) {
	t.Helper()
	wild := netip.IPv6Unspecified()
	for _, p := range s.pods {
		p.app, p.sampler, p.outSampler = s.StartApp(p.Pod), s.StartApp(p.Pod), s.StartOutsideApp()
		do(t, p.app, simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(wild, podEchoPort)})
		p.app.Listen("tcp", p.Name, netip.AddrPortFrom(wild, podReplyPort))
	}
	s.out = s.StartOutsideApp()
	do(t, s.out, simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(wild, outsideEchoPort)})
	s.out.Listen("tcp", "outside", netip.AddrPortFrom(wild, outsideReplyPort))
}

func do(t *testing.T, app *simnode.App, req simnode.AppRequest) simnode.AppResponse {
	t.Helper()
	resp, err := app.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", req.Op, req.Addr, err)
	}
	return resp
}

// handOverZDS ends istio-cni's side of ZDS, as replacing its DaemonSet
// does: the stand-in keeps its pods and reconnects to whoever listens at
// the socket next (the agent).
func (s *scenario) handOverZDS() { s.zt.StopServer() }

var iptablesSaves = []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"}

// installUnrelated installs someone else's rules in a netns, in both
// backends and families: kube-proxy's kind of nat chains (a jump at the top
// of POSTROUTING, before which istio-cni inserts its own), a CNI's mangle
// chain, a filter rule and a raw NOTRACK.
func installUnrelated(t *testing.T, ns string) {
	t.Helper()
	for _, b := range []string{"-legacy", "-nft"} {
		for _, tool := range []string{"iptables", "ip6tables"} {
			reference.Run(t, ns, "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n-A OUTPUT -j KUBE-SERVICES\n-A PREROUTING -j KUBE-SERVICES\n"+
				"-I POSTROUTING 1 -j KUBE-POSTROUTING\n-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\nCOMMIT\n"+
				"*mangle\n:CNI-MARK - [0:0]\n-A PREROUTING -j CNI-MARK\n-A CNI-MARK -p tcp --dport 9 -j MARK --set-xmark 0x7/0xff\nCOMMIT\n"+
				"*filter\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A KUBE-FIREWALL -p tcp --dport 10 -j DROP\nCOMMIT\n"+
				"*raw\n-A OUTPUT -p udp --dport 5353 -j NOTRACK\nCOMMIT\n", tool+b+"-restore", "--noflush")
		}
	}
}

var (
	commentLine = regexp.MustCompile(`(?m)^#.*\n`)
	chainCount  = regexp.MustCompile(`\[\d+:\d+\]`)
)

// rulesSnapshot is every backend's and family's iptables-save (counters
// zeroed, tables only listed empty left out), with istio-cni's lines
// (ISTIO_*) left out unless withIstio, and the nftables tables that are
// neither iptables-nft's nor ours (the drain).
func rulesSnapshot(t *testing.T, ns string, withIstio bool) string {
	t.Helper()
	var b strings.Builder
	for _, tool := range iptablesSaves {
		out := chainCount.ReplaceAllString(commentLine.ReplaceAllString(reference.Run(t, ns, "", tool), ""), "[0:0]")
		b.WriteString("== " + tool + "\n")
		for _, table := range strings.SplitAfter(out, "COMMIT\n") {
			var kept []string
			for _, line := range strings.SplitAfter(table, "\n") {
				if withIstio || !strings.Contains(line, "ISTIO") {
					kept = append(kept, line)
				}
			}
			table = strings.Join(kept, "")
			if strings.Contains(table, "\n-A ") || strings.Contains(table, " - [0:0]") {
				b.WriteString(table)
			}
		}
	}
	b.WriteString("== nftables\n")
	for _, tb := range nftTables(t, ns) {
		if !iptablesNftTable(tb) && tb != "inet "+istiocni.DrainTable {
			b.WriteString(tb + "\n")
		}
	}
	return b.String()
}

// podSnapshot is rulesSnapshot with istio-cni's lines, and the pod's
// policy rules and routes.
func podSnapshot(t *testing.T, ns string) string {
	t.Helper()
	out := rulesSnapshot(t, ns, true)
	for _, args := range [][]string{{"-4", "rule"}, {"-6", "rule"}, {"-4", "route", "show", "table", "all"}, {"-6", "route", "show", "table", "all"}} {
		out += "== ip " + strings.Join(args, " ") + "\n" + reference.Run(t, ns, "", append([]string{"ip"}, args...)...)
	}
	return out
}

func iptablesNftTable(family string) bool {
	f, name, _ := strings.Cut(family, " ")
	return (f == "ip" || f == "ip6") && slices.Contains([]string{"filter", "nat", "mangle", "raw", "security"}, name)
}

// nftTables lists the nftables tables of a netns ("family name"), read
// over netlink: the suite needs no nft binary.
func nftTables(t *testing.T, ns string) []string {
	t.Helper()
	tables, _ := nftLists(t, ns)
	return tables
}

// nftLists lists the nftables tables ("family name") and chains
// ("family table chain") of a netns.
func nftLists(t *testing.T, ns string) (tables, chains []string) {
	t.Helper()
	f, err := os.Open(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(f.Fd())))
	if err != nil {
		t.Fatal(err)
	}
	ts, err := c.ListTables()
	if err != nil {
		t.Fatalf("netns %s: list nftables tables: %v", ns, err)
	}
	for _, tb := range ts {
		tables = append(tables, nftFamily(tb.Family)+" "+tb.Name)
	}
	cs, err := c.ListChains()
	if err != nil {
		t.Fatalf("netns %s: list nftables chains: %v", ns, err)
	}
	for _, ch := range cs {
		chains = append(chains, nftFamily(ch.Table.Family)+" "+ch.Table.Name+" "+ch.Name)
	}
	slices.Sort(tables)
	slices.Sort(chains)
	return tables, chains
}

func nftFamily(f nftables.TableFamily) string {
	switch f {
	case nftables.TableFamilyINet:
		return "inet"
	case nftables.TableFamilyIPv4:
		return "ip"
	case nftables.TableFamilyIPv6:
		return "ip6"
	}
	return fmt.Sprintf("family%d", f)
}

// checkNoIstioCNI asserts that no iptables backend or family, and no
// nftables table or chain, of the netns holds anything of istio-cni's.
func checkNoIstioCNI(t *testing.T, ns string) {
	t.Helper()
	for _, tool := range iptablesSaves {
		if out := reference.Run(t, ns, "", tool); strings.Contains(out, "ISTIO") {
			t.Errorf("%s in %s still holds istio-cni's rules:\n%s", tool, ns, out)
		}
	}
	tables, chains := nftLists(t, ns)
	for _, x := range slices.Concat(tables, chains) {
		if strings.Contains(strings.ToLower(x), "istio") {
			t.Errorf("nftables in %s still holds istio-cni's %s", ns, x)
		}
	}
}

// checkNodeFreeOfIstioCNI asserts the node has neither istio-cni's host
// chain (either backend) nor its probe ipsets.
func (s *scenario) checkNodeFreeOfIstioCNI(t *testing.T) {
	t.Helper()
	node := simnode.NetnsPath(s.NodeNS)
	checkNoIstioCNI(t, node)
	if sets := reference.Run(t, node, "", "ipset", "list", "-n"); strings.Contains(sets, "istio-inpod-probes") {
		t.Errorf("the node still has istio-cni's ipsets: %s", sets)
	}
}

// istiocniPod is pkg/istiocni's reading of a pod.
func istiocniPod(t *testing.T, p *simnode.Pod) *istiocni.Pod {
	t.Helper()
	r, err := istiocni.New().InspectPod(context.Background(), p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// takenOver says whether the pod is enrolled in eBPF and istio-cni's
// rules (iptables or native nftables) are gone from it.
func (s *scenario) takenOver(t *testing.T, p *simnode.Pod) bool {
	t.Helper()
	r := istiocniPod(t, p)
	return s.pinned(t, p) && len(r.Iptables) == 0 && r.Nft == nil
}

// pinned says whether the pod is enrolled in the pinned data path.
func (s *scenario) pinned(t *testing.T, p *simnode.Pod) bool {
	t.Helper()
	return slices.ContainsFunc(agentrun.PinnedPods(t, s.BPFFSDir), func(e inspect.EnrolledPod) bool { return e.UID == p.UID })
}

// streams are long-lived connections through ztunnel, echoing
// periodically in the background; a broken one is a failure.
type streams struct {
	t      *testing.T
	mu     sync.Mutex
	open   map[string]*simnode.App // by name: the app holding it
	errs   []string
	echoes atomic.Int64
	stop   chan struct{}
	done   chan struct{}
}

func startStreams(t *testing.T) *streams {
	st := &streams{t: t, open: map[string]*simnode.App{}, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(st.done)
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-st.stop:
				return
			case <-tick.C:
			}
			st.echoAll(fmt.Sprintf("tick-%d", i))
		}
	}()
	t.Cleanup(st.halt)
	return st
}

func (st *streams) halt() {
	select {
	case <-st.stop:
	default:
		close(st.stop)
	}
	<-st.done
}

// echoAll has every open stream echo a line; it holds the lock, so a
// stream is never closed halfway through.
func (st *streams) echoAll(msg string) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, name := range slices.Sorted(maps.Keys(st.open)) {
		if _, err := st.open[name].Do(simnode.AppRequest{Op: "stream-echo", Name: name, DNSName: msg}); err != nil {
			st.errs = append(st.errs, fmt.Sprintf("%s: %v", name, err))
			delete(st.open, name)
			continue
		}
		st.echoes.Add(1)
	}
}

// openVia opens a stream from app to dst and checks it went through the
// stand-in's listener port; netns is the pod's, whose NAT it went through.
func (st *streams) openVia(zt *simnode.Ztunnel, app *simnode.App, netns, name string, dst netip.AddrPort, port int) {
	st.t.Helper()
	start := time.Now()
	resp := do(st.t, app, simnode.AppRequest{Op: "stream-open", Name: name, Addr: dst})
	var r standin.Record
	var ok bool
	testenv.Poll(recordGrace, func() bool { // the stand-in writes its record as it accepts
		r, ok = recordOf(zt.Records(), resp.Local, dst, start)
		return ok
	})
	if !ok {
		r, ok = remappedRecord(zt.Records(), netns, resp.Local, dst, start)
	}
	if !ok || r.Listener != port || r.Error != "" {
		st.t.Fatalf("stream %s did not go through ztunnel's %d: %+v", name, port, r)
	}
	st.mu.Lock()
	st.open[name] = app
	st.mu.Unlock()
}

// openStreams opens, for every pod and family, an outbound stream (pod to the
// outside host, through :15001) and an inbound one (outside host to the
// pod, through :15006), named with the prefix.
func (s *scenario) openStreams(st *streams, prefix string) {
	st.t.Helper()
	for _, p := range s.pods {
		for _, f := range families(p.Pod) {
			st.openVia(s.zt, p.app, p.NetnsPath(), fmt.Sprintf("%s-out-%s-%s", prefix, p.Name, f.name), netip.AddrPortFrom(f.outside, outsideEchoPort), standin.OutboundPort)
			st.openVia(s.zt, s.out, p.NetnsPath(), fmt.Sprintf("%s-in-%s-%s", prefix, p.Name, f.name), netip.AddrPortFrom(f.pod, podEchoPort), standin.InboundPort)
		}
	}
}

// closeStreams closes the streams whose name starts with one of the
// prefixes, after a last echo of each.
func (st *streams) closeStreams(prefixes ...string) {
	st.t.Helper()
	st.echoAll("last")
	st.mu.Lock()
	defer st.mu.Unlock()
	for name, app := range st.open {
		if !slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(name, p) }) {
			continue
		}
		if _, err := app.Do(simnode.AppRequest{Op: "stream-close", Name: name}); err != nil {
			st.t.Errorf("close stream %s: %v", name, err)
		}
		delete(st.open, name)
	}
}

// check fails the test for every stream that broke, and for streams
// expected open that are not.
func (st *streams) check(want ...string) {
	st.t.Helper()
	st.echoAll("check")
	st.mu.Lock()
	defer st.mu.Unlock()
	for _, e := range st.errs {
		st.t.Errorf("stream broke: %s", e)
	}
	st.errs = nil
	for _, prefix := range want {
		n := 0
		for name := range st.open {
			if strings.HasPrefix(name, prefix) {
				n++
			}
		}
		if n == 0 {
			st.t.Errorf("no stream %s* open", prefix)
		}
	}
	st.t.Logf("streams: %d open, %d echoes so far", len(st.open), st.echoes.Load())
}

type family struct {
	name         string
	pod, outside netip.Addr
}

func families(p *simnode.Pod) []family {
	return []family{{"ipv4", p.V4, simnode.OutsideV4}, {"ipv6", p.V6, simnode.OutsideV6}}
}

// sampler makes a new short connection inbound and outbound, for each pod,
// about every 20 ms (alternating families), and checks each went through
// the stand-in's listener for its direction to its original destination:
// no moment without redirection.
type sampler struct {
	zt      *simnode.Ztunnel
	conns   atomic.Int64
	mu      sync.Mutex
	fails   []string
	nfail   int
	byWhat  map[string]int // failures by pod, direction and family
	tries   map[string]int // connections by pod, direction and family
	pending []sample       // connected, not yet matched to the stand-in's record
	lost    []string       // inbound connections that got no answer (see lostInbound)
	lostBy  map[string]int // those by pod, direction and family
	remaps  []string       // samples matched through a NAT-remapped client port (remappedPeer)
	stop    chan struct{}
	wg      sync.WaitGroup
}

// sample is one sampled connection that connected: it was redirected if
// the stand-in recorded a connection from its client address to its
// original destination on the listener of its direction, at or after it
// was made.
type sample struct {
	key, at string
	i       int
	local   netip.AddrPort // the client's end, the stand-in's peer
	dst     netip.AddrPort
	port    int
	start   time.Time
	reply   *standin.Reply // who answered, as it saw the connection
	netns   string         // the pod's
	// natPeer is the client address the stand-in saw when the pod's NAT
	// remapped the client port (remappedPeer), asked once (askedNAT).
	natPeer  netip.AddrPort
	askedNAT bool
}

// sampleEvery is how often each sampler dials: 20 ms, or 100 ms under
// emulation (hack/vmtest), where at 20 ms the samplers' connections took
// the CPU the agent's takeover and hand-back wait for (the 5.10 guest
// sampled 19031 connections in 225 s; the host about 1000 in 8 s).
func sampleEvery() time.Duration {
	if os.Getenv("AMBIENT_EBPF_GUEST") != "" {
		return 100 * time.Millisecond
	}
	return 20 * time.Millisecond
}

func (s *scenario) startSampler(t *testing.T) *sampler {
	sm := &sampler{zt: s.zt, stop: make(chan struct{}), byWhat: map[string]int{}, lostBy: map[string]int{}, tries: map[string]int{}}
	for _, p := range s.pods {
		sm.run(p.sampler, p.Name+" outbound", standin.OutboundPort, func(f family) netip.AddrPort {
			return netip.AddrPortFrom(f.outside, outsideReplyPort)
		}, p.Pod)
		sm.run(p.outSampler, p.Name+" inbound", standin.InboundPort, func(f family) netip.AddrPort {
			return netip.AddrPortFrom(f.pod, podReplyPort)
		}, p.Pod)
	}
	t.Cleanup(func() { sm.halt() })
	return sm
}

func (sm *sampler) run(app *simnode.App, what string, port int, dst func(family) netip.AddrPort, p *simnode.Pod) {
	sm.wg.Go(func() {
		tick := time.NewTicker(sampleEvery())
		defer tick.Stop()
		fams := families(p)
		for i := 0; ; i++ {
			select {
			case <-sm.stop:
				return
			case <-tick.C:
			}
			f := fams[i%len(fams)]
			addr := dst(f)
			start := time.Now()
			resp, err := app.Dial("tcp", simnode.AppRequest{Addr: addr})
			sm.conns.Add(1)
			key, at := what+" "+f.name, time.Now().Format("15:04:05.000")
			sm.mu.Lock()
			sm.tries[key]++
			if err == nil {
				sm.pending = append(sm.pending, sample{key: key, at: at, i: i, local: resp.Local, dst: addr, port: port, start: start, reply: resp.Reply, netns: p.NetnsPath()})
			}
			sm.mu.Unlock()
			switch {
			case err != nil && port == standin.InboundPort && lostInbound(err):
				sm.lose(key, "%s %s #%d: %v%s", at, key, i, err, sm.lostDetails(sample{local: resp.Local, dst: addr, start: start, netns: p.NetnsPath()}))
			case err != nil:
				sm.fail(key, "%s %s #%d: %v", at, key, i, err)
			}
		}
	})
}

// recordGrace is how long a sampled connection may wait for the
// stand-in's record of it: under emulation the stand-in can write one
// seconds after its accept.
const recordGrace = 10 * time.Second

// recordOf finds the stand-in's record of a connection made at start from
// local to the original destination dst: made at or after it, within
// recordGrace. Matching the client address alone is not enough: client
// ports come back, for other pods and other destinations too.
func recordOf(recs []standin.Record, local, dst netip.AddrPort, start time.Time) (standin.Record, bool) {
	i := slices.IndexFunc(recs, func(r standin.Record) bool {
		return r.Peer == local && r.OrigDst == dst && !r.Time.Before(start.Add(-time.Second)) && r.Time.Before(start.Add(recordGrace))
	})
	if i < 0 {
		return standin.Record{}, false
	}
	return recs[i], true
}

// remappedRecord is recordOf for a connection whose client port the pod's
// NAT changed (remappedPeer): the stand-in's record is from the new port.
func remappedRecord(recs []standin.Record, netns string, local, dst netip.AddrPort, start time.Time) (standin.Record, bool) {
	peer, ok := remappedPeer(netns, local, dst)
	if !ok {
		return standin.Record{}, false
	}
	return recordOf(recs, peer, dst, start)
}

// settle matches the connections sampled so far to the stand-in's records
// (recordOf): one on the wrong listener failed, and so did one still without a
// record once it is older than recordGrace. With wait, settle returns only
// when every connection so far is matched or failed; without, the rest stay
// pending.
func (sm *sampler) settle(wait bool) {
	sm.mu.Lock()
	todo := sm.pending
	sm.pending = nil
	sm.mu.Unlock()
	for {
		byPeer := map[netip.AddrPort][]standin.Record{}
		for _, r := range sm.zt.Records() {
			byPeer[r.Peer] = append(byPeer[r.Peer], r)
		}
		var left []sample
		for _, c := range todo {
			r, ok := recordOf(byPeer[c.local], c.local, c.dst, c.start)
			if !ok && !c.askedNAT && time.Since(c.start) > time.Second {
				// Asked once, while conntrack still holds the
				// connection (two minutes in TIME_WAIT).
				c.askedNAT = true
				if peer, remapped := remappedPeer(c.netns, c.local, c.dst); remapped {
					c.natPeer = peer
				}
			}
			if !ok && c.natPeer.IsValid() {
				if r, ok = recordOf(byPeer[c.natPeer], c.natPeer, c.dst, c.start); ok {
					sm.mu.Lock()
					sm.remaps = append(sm.remaps, fmt.Sprintf("%s %s #%d from %s to %s: the stand-in saw it from %s", c.at, c.key, c.i, c.local, c.dst, c.natPeer))
					sm.mu.Unlock()
				}
			}
			switch {
			case ok && (r.Listener != c.port || r.Error != ""):
				sm.fail(c.key, "%s %s #%d from %s to %s: not redirected to :%d with its original destination: %+v", c.at, c.key, c.i, c.local, c.dst, c.port, r)
			case !ok && time.Since(c.start) > recordGrace && !sm.detailed():
				sm.fail(c.key, "%s %s #%d from %s to %s: not redirected (no record of the stand-in; answered by %+v)", c.at, c.key, c.i, c.local, c.dst, c.reply)
			case !ok && time.Since(c.start) > recordGrace:
				sm.fail(c.key, "%s %s #%d from %s to %s: not redirected (no record of the stand-in; answered by %+v; the stand-in's records then from %s or to %s from %s: %v; the pod's conntrack entries with port %d:\n%s)", c.at, c.key, c.i, c.local, c.dst, c.reply, c.local, c.dst, c.local.Addr(), nearRecords(sm.zt.Records(), c), c.local.Port(), conntrackDump(c.netns, c.hasPort))
			case !ok:
				left = append(left, c)
			}
		}
		todo = left
		if !wait || len(todo) == 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	sm.mu.Lock()
	sm.pending = append(todo, sm.pending...)
	sm.mu.Unlock()
}

// nearRecords lists, for a failure's message, the stand-in's records
// around c's time that could be c's with a field changed: from c's client
// address and port to any original destination (an original destination
// lost), and from c's client address, any port, to c's destination (a
// client port NAT remapped).
func nearRecords(recs []standin.Record, c sample) []string {
	var out []string
	for _, r := range recs {
		after := r.Time.After(c.start.Add(-sampleEvery()))
		samePeer := r.Peer == c.local && r.Time.Before(c.start.Add(recordGrace))
		sameDst := r.Peer.Addr() == c.local.Addr() && r.OrigDst == c.dst && r.Time.Before(c.start.Add(2*sampleEvery()))
		if after && (samePeer || sameDst) {
			out = append(out, fmt.Sprintf("%s peer %s local %s to %s (%s) on :%d %s", r.Time.Format("15:04:05.000"), r.Peer, r.Local, r.OrigDst, r.OrigDstFrom, r.Listener, r.Error))
		}
	}
	return out
}

// hasPort says whether a conntrack entry has c's client port on either
// side of either tuple.
func (c sample) hasPort(f conntrack.Flow) bool {
	p := c.local.Port()
	return f.TupleOrig.Proto.SourcePort == p || f.TupleOrig.Proto.DestinationPort == p ||
		f.TupleReply.Proto.SourcePort == p || f.TupleReply.Proto.DestinationPort == p
}

// detailed says whether the next failure still gets the costly details
// (the stand-in's nearby records, a conntrack dump): only the first few
// do, as a test that unredirects a pod on purpose fails hundreds.
func (sm *sampler) detailed() bool {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return sm.nfail < 3
}

func (sm *sampler) fail(key, format string, args ...any) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	sm.nfail++
	sm.byWhat[key]++
	if len(sm.fails) < 20 {
		sm.fails = append(sm.fails, fmt.Sprintf(format, args...))
	}
}

func (sm *sampler) halt() {
	select {
	case <-sm.stop:
	default:
		close(sm.stop)
	}
	sm.wg.Wait()
}

// Rarely (one sample in several thousand, on the host kernel) a new
// inbound connection gets no answer within the dial's 3 s (its connect or
// its reply times out), or is refused: seen under istio-cni's rules alone,
// with no agent on the node (TestHarnessUnderIstioCNI), so it is the
// simulated node's or istio-cni's (the stand-in relaying thousands of
// connections from one client address, client ports coming back), not the
// eBPF redirection's; its cause is not found yet, and the first ones carry
// what the sampler knows of them (lostDetails). Such a loss is counted
// apart and tolerated up to lostAllowed of a phase's connections;
// everything else (an unredirected connection, a broken stream) fails at
// once. On 5.10 such losses across takeovers had a cause of ours, found
// with lostDetails and fixed (TestAClientBackFromThePortOfAnIstioCNIConnection).
func lostInbound(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "no reply") || strings.Contains(msg, "connection refused") ||
		strings.HasPrefix(msg, "connect ") && strings.HasSuffix(msg, "i/o timeout")
}

// lostDetails is what the first few lost inbound connections carry in
// their message, for the cause still to be found: the stand-in's records
// near it and the pod's conntrack entries with its client port (c.local,
// when the dial got one).
func (sm *sampler) lostDetails(c sample) string {
	sm.mu.Lock()
	first := len(sm.lost) < 3
	sm.mu.Unlock()
	if !first || c.local.Port() == 0 {
		return ""
	}
	var earlier []string
	for _, r := range sm.zt.Records() {
		if r.Peer == c.local && r.Time.Before(c.start) {
			earlier = append(earlier, fmt.Sprintf("%s to %s on :%d %s", r.Time.Format("15:04:05.000"), r.OrigDst, r.Listener, r.Error))
		}
	}
	state := "?"
	if r, err := istiocni.New().InspectPod(context.Background(), c.netns); err == nil {
		drain, _ := istiocni.HasDrain(context.Background(), c.netns)
		state = fmt.Sprintf("istio-cni's rules in %v, drain %v", r.Backends(), drain)
	}
	return fmt.Sprintf(" (the pod then: %s; the stand-in's records then from %s or to %s from %s: %v; earlier from %s: %v; the pod's conntrack entries with port %d:\n%s)",
		state, c.local, c.dst, c.local.Addr(), nearRecords(sm.zt.Records(), c), c.local, earlier, c.local.Port(), conntrackDump(c.netns, c.hasPort))
}

// lostAllowed is the share of a phase's sampled connections that may be
// lost inbound (lostInbound) before the check fails.
const lostAllowed = 1.0 / 500

func (sm *sampler) lose(key, format string, args ...any) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	sm.lostBy[key]++
	sm.lost = append(sm.lost, fmt.Sprintf(format, args...))
}

// result is what the sampler saw so far: connections made, failures
// (unredirected or failed), and the first failures.
func (sm *sampler) result() (conns int64, failures int, first []string) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return sm.conns.Load(), sm.nfail, slices.Clone(sm.fails)
}

// failuresBy counts the failures so far by pod, direction and family
// ("legacy inbound ipv6").
func (sm *sampler) failuresBy() map[string]int {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return maps.Clone(sm.byWhat)
}

// lostBy counts the lost inbound connections (lostInbound) so far by pod,
// direction and family.
func (sm *sampler) lostByWhat() map[string]int {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return maps.Clone(sm.lostBy)
}

// check fails the test if any sampled connection failed or went
// unredirected so far, and logs the count.
func (sm *sampler) check(t *testing.T, phase string) {
	t.Helper()
	sm.settle(true)
	conns, n, first := sm.result()
	sm.mu.Lock()
	t.Logf("sampler %s: %d connections (%v), %d failures", phase, conns, sm.tries, n)
	if len(sm.remaps) > 0 {
		t.Logf("sampler %s: %d connections so far had their client port remapped by the pod's NAT:\n%s", phase, len(sm.remaps), strings.Join(sm.remaps, "\n"))
	}
	sm.mu.Unlock()
	if n > 0 {
		t.Errorf("sampler %s: %d of %d connections failed or were not redirected (%v); first:\n%s", phase, n, conns, sm.failuresBy(), strings.Join(first, "\n"))
	}
	sm.mu.Lock()
	lost := slices.Clone(sm.lost)
	sm.mu.Unlock()
	switch {
	case float64(len(lost)) > lostAllowed*float64(conns):
		t.Errorf("sampler %s: %d of %d inbound connections lost, more than the harness's %.1f%% (lostInbound):\n%s", phase, len(lost), conns, lostAllowed*100, strings.Join(lost, "\n"))
	case len(lost) > 0:
		t.Logf("sampler %s: %d of %d inbound connections lost (the harness's, see lostInbound):\n%s", phase, len(lost), conns, strings.Join(lost, "\n"))
	}
}

// waitSamples waits until the sampler made n more connections: time for
// traffic to meet whatever just changed.
func (sm *sampler) waitSamples(t *testing.T, n int64) {
	t.Helper()
	target := sm.conns.Load() + n
	testenv.Eventually(t, time.Minute, fmt.Sprintf("%d more sampled connections", n), func() bool { return sm.conns.Load() >= target })
}
