// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Variants of the lean figures besides direct, iptables and ebpf.
const (
	// variantTrace is the ebpf-lean pair with someone tracing (issue
	// 18): the agent reads the ring buffer and streams every event to
	// `ambient-ebpf trace -o json`.
	variantTrace = "ebpf+trace"
	// variantProxy is the direct pair through the same lean proxies,
	// addressed explicitly (the client connects to its pod's proxy,
	// which forwards to the server pod's, which forwards to the server):
	// the same three TCP connections and relays as a meshed connection,
	// with no redirection and no conntrack in the pods. redirect_cpu_us
	// is the meshed paths' CPU less this one's.
	variantProxy = "direct+proxy"
	// variantTransparent is the direct pair through the same lean
	// proxies addressed explicitly, with ztunnel's socket work all the
	// same (leanListener.Contract): the original destination asked for,
	// the inbound upstream transparent from the client's address and its
	// replies routed back to it by a policy route. What a meshed
	// connection costs beyond it (redirect_own_cpu_us) is the redirection
	// alone: capture, the original destination's answer, the return path.
	variantTransparent = "direct+transparent"
)

// The explicit listeners of the direct+proxy baseline (clear of ztunnel's
// ports, which the dataplane files listeners of).
const (
	explicitOutPort = 15101
	explicitInPort  = 15106
	// direct+transparent's
	contractOutPort = 15201
	contractInPort  = 15206
)

// contractTable is the routing table of the direct server pod's policy
// route that brings the replies to direct+transparent's upstream sockets
// (bound to the client's address) back to them, as the return mark's
// route does on a meshed path. The rule takes the server pod's ephemeral
// ports, where those sockets get theirs; the client's own connections to
// the server come from the client pod's.
const contractTable = "1534"

// agentVariants are variants of the ebpf-lean pair that need the node
// agent started with flags: before each of a variant's measurements the
// agent is restarted with them (it adopts the pods, as on an upgrade), and
// before the next other column's without. A variant whose flags the agent binary does not list
// in its --help is not measured, and the notes say so. Issue 15's sockmap
// acceleration is measured by naming its flag here.
var agentVariants = []struct {
	name  string
	flags []string
}{
	// ebpf+root attaches every socket program to the cgroup root, as
	// before --pods-cgroup: the cost of the node-wide half the pods'
	// sockets meet there besides the programs on their own cgroup.
	{"ebpf+root", []string{"--pods-cgroup=none"}},
	// ebpf+sockmap (--sockmap-accel=ztunnel) is left out: through the
	// lean proxy a bulk sender's write(2) failed with ENOMEM (the sk_msg
	// redirect into a proxy socket whose receive queue is full fails the
	// send instead of blocking it); `make bench-sockmap` measures the
	// acceleration through the stand-in, and issue 15's note has it.
}

// leanVariant is one column of the lean figures: a path, and how it runs.
type leanVariant struct {
	name string // direct, iptables, ebpf, direct+proxy, direct+transparent, or a variant of ebpf
	path *path
	addr string // where the client connects
	// proxied: the lean proxy relays the variant's connections (all but
	// direct).
	proxied    bool
	trace      bool     // someone traces while it runs
	agentFlags []string // the node agent runs with these for the variant's block
}

// base tells the three paths every lean figure has.
func (v leanVariant) base() bool {
	return v.name == pathDirect || v.name == pathIptables || v.name == pathEBPF
}

// leanRun is one measurement of a lean variant.
type leanRun struct {
	loadResult
	// cpu is the CPU time of the client and server pods' cgroups, both
	// lean proxies' cgroups and the ksoftirqd threads (softirq of this
	// kernel is charged to whichever task it interrupted: without
	// CONFIG_IRQ_TIME_ACCOUNTING, receive processing run on the way out
	// of a send lands in the sender's time), of which softirqd and
	// proxyCPU.
	cpu, softirqd, proxyCPU time.Duration
	clientCPU, serverCPU    time.Duration // the two pods' cgroups
	// tracerCPU is the agent's and the tracer's cgroups' CPU time while
	// tracing; events and lost what the tracer printed and missed.
	tracerCPU    time.Duration
	events, lost int64
}

// leanVariants are the lean figures' columns in the order each
// repetition runs them: the two baselines first.
func (e *env) leanVariants(res *Results) []leanVariant {
	direct, ipt, ebpf := e.paths[pathDirect], e.paths[pathIptablesLean], e.paths[pathEBPFLean]
	meshed := func(name string, p *path) leanVariant {
		return leanVariant{name: name, path: p, addr: p.echo, proxied: true}
	}
	proxy := meshed(variantProxy, direct)
	proxy.addr = fmt.Sprintf("%s:%d", direct.client.V4, explicitOutPort)
	trace := meshed(variantTrace, ebpf)
	trace.trace = true
	vs := []leanVariant{{name: pathDirect, path: direct, addr: direct.echo}, proxy}
	if e.s.exposeCollisions {
		res.Notes["variant "+variantTransparent] = "not measured: its return route takes the server pod's ephemeral ports, which BENCH_EXPOSE_COLLISIONS=1 shares with the client pod's"
	} else {
		transparent := meshed(variantTransparent, direct)
		transparent.addr = fmt.Sprintf("%s:%d", direct.client.V4, contractOutPort)
		vs = append(vs, transparent)
	}
	vs = append(vs, meshed(pathIptables, ipt), meshed(pathEBPF, ebpf), trace)
	for _, av := range agentVariants {
		if missing := e.agent.unknownFlags(av.flags); len(missing) > 0 {
			res.Notes["variant "+av.name] = "not measured: the agent has no " + strings.Join(missing, ", ") + " (agentVariants in test/bench/lean_test.go)"
			continue
		}
		v := meshed(av.name, ebpf)
		v.agentFlags = av.flags
		vs = append(vs, v)
	}
	return vs
}

// addLean has the lean proxy serve a path's two pods: ztunnel's
// listeners in meshed pods; in the direct pair explicit listeners for the
// direct+proxy and direct+transparent baselines (client pod: to the
// server pod's; server pod: to the server), and the server pod's policy
// route for the latter's replies. The proxy runs in the node netns like
// ztunnel, in a cgroup below the node's root (where the socket hooks
// apply, as to ztunnel's), on one OS thread (GOMAXPROCS=1).
func (e *env) addLean(p *path) {
	if p.name == pathDirect && !e.s.exposeCollisions {
		e.node.IP(p.server.NS, "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", contractTable)
		e.node.IP(p.server.NS, "rule", "add", "to", p.client.V4.String(), "ipproto", "tcp", "dport", "47000-60999",
			"lookup", contractTable, "priority", "100")
	}
	for i, pod := range []*simnode.Pod{p.client, p.server} {
		var ls []leanListener
		if p.name == pathDirect {
			ls = [][]leanListener{
				{
					{Port: explicitOutPort, To: netip.AddrPortFrom(p.server.V4, explicitInPort)},
					{Port: contractOutPort, To: netip.AddrPortFrom(p.server.V4, contractInPort), Contract: true},
				},
				{
					{Port: explicitInPort, Inbound: true, To: netip.AddrPortFrom(p.server.V4, echoPort)},
					{Port: contractInPort, Inbound: true, To: netip.AddrPortFrom(p.server.V4, echoPort), Contract: true},
				},
			}[i]
		}
		if err := call(e.leanpx, leanRequest{Op: "add", Pod: pod.Name, Netns: pod.NetnsPath(), Listeners: ls}, nil); err != nil {
			e.t.Fatalf("lean proxy for %s: %v", pod.Name, err)
		}
	}
}

func (e *env) leanCounts(pod *simnode.Pod) leanCountsReply {
	var c leanCountsReply
	if err := call(e.leanpx, leanRequest{Op: "counts", Pod: pod.Name}, &c); err != nil {
		e.t.Fatalf("lean proxy counts: %v", err)
	}
	return c
}

// lean measures the redirection itself: the direct pair and both backends
// through lean proxies, the ebpf pair also with someone tracing (and with
// each agent variant), alternating in every repetition. Per repetition and
// variant: conn_rate_seq (and its CPU per connection), conn_rate_conc, rr
// latency; for the three base paths also the conntrack entries made per
// connection.
func (e *env) lean(res *Results) {
	s := e.s
	vs := e.leanVariants(res)
	for _, v := range vs {
		if !v.trace && v.agentFlags == nil { // a warm-up of every column the agent runs plainly for
			e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: 200 * time.Millisecond})
		}
	}
	seq, conc, p50, p99 := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	cpu, redirect, meshExtra, softirqd := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	redirectOwn := map[string][]float64{}
	proxyCPU, clientCPU, serverCPU := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	ctPod, ctNode, tput := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	phases := [3]map[string][]float64{{}, {}, {}} // connect, exchange, close
	seq1, redirect1, redirectOwn1, busy1 := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	var tracerCPU, events, lost []float64
	// Each kind of measurement goes round every variant before the next
	// kind starts, so that the columns a figure subtracts or divides are
	// measured seconds apart; the agent is restarted only where a
	// variant's flags differ from the previous one's.
	for rep := range s.reps {
		// Each repetition starts one column further on: a column's runs
		// follow different columns' (their TIME_WAIT sockets, the CPU
		// they leave busy), not always the same one's.
		order := append(slices.Clone(vs[rep%len(vs):]), vs[:rep%len(vs)]...)
		runs := map[string]leanRun{}
		for _, v := range order {
			e.agentFlags(v.agentFlags)
			runs[v.name] = e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: s.duration})
		}
		var directCPU, proxiedCPU, transparentCPU float64
		for _, v := range vs {
			r := runs[v.name]
			seq[v.name] = append(seq[v.name], rate(r.run()))
			if r.Conns == 0 {
				continue
			}
			c := us(r.cpu) / float64(r.Conns)
			cpu[v.name] = append(cpu[v.name], c)
			for i, d := range []time.Duration{r.Phases.Connect, r.Phases.Exchange, r.Phases.Close} {
				phases[i][v.name] = append(phases[i][v.name], us(d)/float64(r.Conns))
			}
			softirqd[v.name] = append(softirqd[v.name], us(r.softirqd)/float64(r.Conns))
			clientCPU[v.name] = append(clientCPU[v.name], us(r.clientCPU)/float64(r.Conns))
			serverCPU[v.name] = append(serverCPU[v.name], us(r.serverCPU)/float64(r.Conns))
			if v.proxied {
				proxyCPU[v.name] = append(proxyCPU[v.name], us(r.proxyCPU)/float64(r.Conns))
			}
			switch v.name {
			case pathDirect:
				directCPU = c
			case variantProxy:
				proxiedCPU = c
				meshExtra[v.name] = append(meshExtra[v.name], c-directCPU)
			case variantTransparent:
				transparentCPU = c
				meshExtra[v.name] = append(meshExtra[v.name], c-directCPU)
				redirect[v.name] = append(redirect[v.name], c-proxiedCPU) // the contract's socket work alone
			default:
				redirect[v.name] = append(redirect[v.name], c-proxiedCPU)
				meshExtra[v.name] = append(meshExtra[v.name], c-directCPU)
				if transparentCPU != 0 {
					redirectOwn[v.name] = append(redirectOwn[v.name], c-transparentCPU)
				}
			}
			if v.trace {
				tracerCPU = append(tracerCPU, us(r.tracerCPU)/float64(r.Conns))
				events = append(events, float64(r.events)/float64(r.Conns))
				lost = append(lost, float64(r.lost))
			}
		}
		for _, v := range order {
			e.agentFlags(v.agentFlags)
			conc[v.name] = append(conc[v.name], rate(e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: s.duration, Conc: s.conc}).run()))
		}
		for _, v := range order {
			e.agentFlags(v.agentFlags)
			rr := e.measureLean(v, loadRequest{Op: "rr", Addr: v.addr, Count: s.rtts})
			p50[v.name] = append(p50[v.name], us(percentile(rr.RTTs, 50)))
			p99[v.name] = append(p99[v.name], us(percentile(rr.RTTs, 99)))
		}
		for _, v := range order {
			if v.name == variantProxy || v.name == variantTransparent { // their explicit listeners lead to the echo server only
				continue
			}
			e.agentFlags(v.agentFlags)
			b := e.measureLean(v, loadRequest{Op: "bulk", Addr: v.path.sink, Duration: s.duration})
			tput[v.name] = append(tput[v.name], float64(b.Bytes)*8/b.Elapsed.Seconds()/1e9)
		}
		for _, v := range vs {
			if v.base() {
				e.agentFlags(nil)
				pod, node := e.conntrackPerConn(v)
				ctPod[v.name], ctNode[v.name] = append(ctPod[v.name], pod), append(ctNode[v.name], node)
			}
		}
		e.leanOneCPU(order, seq1, redirect1, redirectOwn1, busy1)
		slog.Info("lean repetition done", "rep", rep+1, "of", s.reps, "conn_seq", last(seq), "rr_p50_us", last(p50), "redirect_cpu_us", last(redirect))
	}
	e.agentFlags(nil)
	cpuNote := "CPU time (cgroup v2 cpu.stat usage_usec, exact) of the client and server pods' cgroups and of the lean proxy's cgroup, " +
		"plus the ksoftirqd threads' (/proc/<pid>/schedstat), during each conn_rate_seq run, per connection"
	res.Figures = append(res.Figures,
		newFigure("lean_conn_rate_seq", "conn/s", "higher", ">= 1.3x iptables", seq),
		newFigure("lean_conn_rate_conc", "conn/s", "higher", ">= 1.3x iptables", conc),
		newFigure("lean_rr_latency_p50", "us", "lower", "<= 0.8x iptables", p50),
		newFigure("lean_rr_latency_p99", "us", "lower", "<= 0.8x iptables", p99),
		newFigure("lean_conn_rate_seq_1cpu", "conn/s", "higher", "ebpf >= 0.97x direct+proxy", seq1).WithNote(oneCPUNote),
		newFigure("redirect_1cpu_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", redirect1).WithNote(
			"1/lean_conn_rate_seq_1cpu of the meshed path minus direct+proxy's of the same repetition: with every process of the "+
				"connection on one CPU, kept busy, a connection's time is the CPU it costs, all of it (softirq, kernel threads, what "+
				"no cgroup is charged); direct+transparent: ztunnel's socket work alone"),
		newFigure("redirect_own_1cpu_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", redirectOwn1).WithNote(
			"the same minus direct+transparent's: the redirection alone"),
		newFigure("lean_throughput", "Gbit/s", "higher", "", tput).WithNote("as throughput, through the lean proxy (128 KiB writes; the proxy relays up to 64 KiB a read)"),
		newFigure("lean_conn_cpu_us", "us CPU/conn", "lower", "", cpu).WithNote(cpuNote+"; direct: no proxy"),
		newFigure("redirect_cpu_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", redirect).WithNote(
			"lean_conn_cpu_us of the meshed path minus direct+proxy's of the same repetition: what the redirection costs (capture, "+
				"SO_ORIGINAL_DST, the return path, conntrack and NAT where there are any) and ztunnel's socket contract (its transparent "+
				"inbound upstream), the relays and the three TCP connections being the same on both sides; direct+transparent: the "+
				"contract's socket work alone"),
		newFigure("redirect_own_cpu_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", redirectOwn).WithNote(
			"lean_conn_cpu_us of the meshed path minus direct+transparent's of the same repetition: the redirection alone (capture, "+
				"the original destination's answer, the return path, conntrack and NAT where there are any), the proxy's socket work "+
				"(SO_ORIGINAL_DST asked, the inbound upstream bound to the client's address) being the same on both sides"),
		newFigure("meshed_extra_cpu_us", "us CPU/conn", "lower", "", meshExtra).WithNote(
			"lean_conn_cpu_us minus direct's (no proxy) of the same repetition: the redirection plus the proxy's two relays and the two "+
				"extra TCP connections a meshed connection makes"),
		newFigure("lean_proxy_cpu_us", "us CPU/conn", "lower", "", proxyCPU).WithNote("the lean proxy's cgroup alone (both relays), per connection of conn_rate_seq"),
		newFigure("conntrack_entries_per_conn", "entries/conn", "lower", "0 for ebpf", ctPod).WithNote(
			"conntrack entries in the client and the server pod's netns per connection: both tables and the node's flushed (ctnetlink), "+
				fmt.Sprint(ctConns)+" sequential connections, then nf_conntrack_count in each netns"),
		newFigure("conntrack_node_entries_per_conn", "entries/conn", "lower", "", ctNode).WithNote(
			"the same in the node netns: every path's pod-to-pod hop is routed there, and the node tracks it (its iptables rules: "+
				"the reference's host-probe SNAT, as kube-proxy's would)"),
	)
	if sm := summarize(tracerCPU); sm != nil {
		res.Notes["tracing: the tracer's CPU per connection (ebpf+trace conn_rate_seq)"] = fmt.Sprintf(
			"%.1f us (the agent's ring-buffer reader and gRPC stream plus ambient-ebpf trace -o json; not in redirect_cpu_us), %.1f events per connection, %.0f lost per run (median)",
			sm.Median, summarize(events).Median, summarize(lost).Median)
	}
	var phaseParts, busyParts []string
	for _, v := range vs {
		if sm := summarize(phases[0][v.name]); sm != nil {
			phaseParts = append(phaseParts, fmt.Sprintf("%s: %.0f / %.0f / %.0f", v.name, sm.Median, summarize(phases[1][v.name]).Median, summarize(phases[2][v.name]).Median))
		}
		if sm := summarize(busy1[v.name]); sm != nil {
			busyParts = append(busyParts, fmt.Sprintf("%s %.1f%%", v.name, sm.Median))
		}
	}
	res.Notes["lean: a connection's phases (us, medians of the conn_rate_seq runs): connect / request to response / close"] = strings.Join(phaseParts, "; ")
	res.Notes["lean: the pinned CPU's busy share during lean_conn_rate_seq_1cpu (medians)"] = strings.Join(busyParts, "; ")
	var parts []string
	for _, v := range vs {
		if sm := summarize(clientCPU[v.name]); sm != nil {
			part := fmt.Sprintf("%s: client pod %.0f, server pod %.0f", v.name, sm.Median, summarize(serverCPU[v.name]).Median)
			if px := summarize(proxyCPU[v.name]); px != nil {
				part += fmt.Sprintf(", lean proxy %.0f", px.Median)
			}
			parts = append(parts, part+fmt.Sprintf(", ksoftirqd %.1f", summarize(softirqd[v.name]).Median))
		}
	}
	res.Notes["lean: CPU per connection by where it ran (us, medians of the conn_rate_seq runs; ksoftirqd machine-wide)"] = strings.Join(parts, "; ")
}

// oneCPUNote says what lean_conn_rate_seq_1cpu is.
const oneCPUNote = "lean_conn_rate_seq with the client, the server and the lean proxy of every lean pair bound to the last CPU, runs twice as long as the others: a " +
	"connection's steps run one after the other on a CPU kept busy (see the busy-share note), so the rate is the inverse of what a " +
	"connection costs there, without the waits for another CPU to wake that make the two-CPU rates a latency"

// leanOneCPU runs conn_rate_seq on every variant, in order, with every
// process of the lean pairs (load generators, servers, the lean proxy)
// bound to the last CPU, and files the rate, its inverse less
// direct+proxy's and direct+transparent's, and how busy the CPU was.
// On two CPUs a sequential connection waits, at each hop between the
// client, the proxy and the server, for a CPU to wake; on this
// virtual machine that wait moved a column's rate by as much as the
// redirection does. On one CPU the next step is always runnable.
func (e *env) leanOneCPU(order []leanVariant, seq, redirect, redirectOwn, busy map[string][]float64) {
	cpu := runtime.NumCPU() - 1
	procs := []*simnode.Proc{e.leanpx}
	for _, name := range []string{pathDirect, pathIptablesLean, pathEBPFLean} {
		procs = append(procs, e.paths[name].gen, e.paths[name].srv)
	}
	for _, p := range procs {
		e.pin(p, cpu)
	}
	defer func() {
		for _, p := range procs {
			e.pin(p)
		}
	}()
	perConn := map[string]float64{}
	for _, v := range order {
		e.agentFlags(v.agentFlags)
		idle0, total0 := cpuTicks(cpu)
		r := e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: 2 * e.s.duration})
		idle1, total1 := cpuTicks(cpu)
		seq[v.name] = append(seq[v.name], rate(r.run()))
		if r.Conns > 0 {
			perConn[v.name] = us(r.Elapsed) / float64(r.Conns)
		}
		if total1 > total0 {
			busy[v.name] = append(busy[v.name], 100*(1-float64(idle1-idle0)/float64(total1-total0)))
		}
	}
	for name, c := range perConn {
		if p, ok := perConn[variantProxy]; ok && name != variantProxy && name != pathDirect {
			redirect[name] = append(redirect[name], c-p)
		}
		if t, ok := perConn[variantTransparent]; ok && name != variantProxy && name != variantTransparent && name != pathDirect {
			redirectOwn[name] = append(redirectOwn[name], c-t)
		}
	}
}

// cpuTicks reads one CPU's idle (idle and iowait) and total time from
// /proc/stat, in clock ticks.
func cpuTicks(cpu int) (idle, total int64) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	prefix := fmt.Sprintf("cpu%d ", cpu)
	for l := range strings.Lines(string(b)) {
		rest, ok := strings.CutPrefix(l, prefix)
		if !ok {
			continue
		}
		for i, f := range strings.Fields(rest) {
			v, _ := strconv.ParseInt(f, 10, 64)
			if i < 8 { // user nice system idle iowait irq softirq steal; guest time is in user's
				total += v
			}
			if i == 3 || i == 4 {
				idle += v
			}
		}
	}
	return idle, total
}

// run turns a lean measurement into the shape rate() takes.
func (r leanRun) run() run { return run{loadResult: r.loadResult} }

// ctConns is how many connections conntrackPerConn makes.
const ctConns = 300

// conntrackPerConn counts the conntrack entries a path makes per
// connection, in its two pods' netns together and in the node netns:
// the tables are flushed, ctConns sequential connections made, and the
// tables counted (their entries outlive the connections: TIME_WAIT holds
// an entry 120 s).
func (e *env) conntrackPerConn(v leanVariant) (pod, node float64) {
	p := v.path
	for _, ns := range []string{p.client.NS, p.server.NS, e.node.NodeNS} {
		if err := ctFlush(ns); err != nil {
			e.t.Fatal(err)
		}
	}
	r := e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Count: ctConns, Duration: time.Minute})
	count := func(ns string) int {
		n, err := ctCount(ns)
		if err != nil {
			e.t.Fatalf("conntrack count in %s: %v", ns, err)
		}
		return n
	}
	c := float64(max(r.Conns, 1))
	return float64(count(p.client.NS)+count(p.server.NS)) / c, float64(count(e.node.NodeNS)) / c
}

// agentFlags has the node agent run with flags (a variant's, or none),
// restarting it when it runs with others.
func (e *env) agentFlags(flags []string) {
	if !slices.Equal(e.agent.flags, flags) {
		e.restartAgent(flags...)
	}
}

// restartAgent stops the node agent and starts it again with flags; it
// adopts every pod, and ztunnel (the acker) reconnects.
func (e *env) restartAgent(flags ...string) {
	e.agent.stop()
	e.agent.start(flags...)
	e.agent.waitFor("ztunnel to reconnect", func(st cli.Status) bool { return st.Agent.ZtunnelConnections > 0 })
}

// measureLean runs req on the variant's load generator and checks the path
// as measure does: nothing through the stand-in on direct, every
// connection through both lean proxies on the lean paths (and redirected
// by the dataplane on ebpf), and, while tracing, an event for every
// connection. With req.Storm failed connections are counted, not fatal.
func (e *env) measureLean(v leanVariant, req loadRequest) leanRun {
	e.t.Helper()
	p := v.path
	zt0 := e.ztCounts()
	var out0, in0 leanCountsReply
	var proxyCG []string
	if v.proxied {
		out0, in0, proxyCG = e.leanCounts(p.client), e.leanCounts(p.server), []string{e.leanCG}
	}
	var dp0 inspect.Stats
	if p.ebpf() {
		dp0 = e.dpStats(p.client)
	}
	if v.trace {
		e.startTrace()
	}
	hot := append([]string{p.client.Cgroup, p.server.Cgroup}, proxyCG...)
	tracing := []string{e.agent.cgroup, e.tracerCG}
	cpu0, sirq0, tr0, px0 := cgroupsCPU(hot), threadsCPU(e.softirqd), cgroupsCPU(tracing), cgroupsCPU(proxyCG)
	cl0, sv0 := cgroupsCPU([]string{p.client.Cgroup}), cgroupsCPU([]string{p.server.Cgroup})
	var r leanRun
	if err := call(p.gen, req, &r.loadResult); err != nil {
		e.t.Fatalf("%s %s on %s: %v", req.Op, req.Addr, v.name, err)
	}
	sirq := threadsCPU(e.softirqd) - sirq0
	r.cpu, r.softirqd, r.tracerCPU, r.proxyCPU = cgroupsCPU(hot)-cpu0+sirq, sirq, cgroupsCPU(tracing)-tr0, cgroupsCPU(proxyCG)-px0
	r.clientCPU, r.serverCPU = cgroupsCPU([]string{p.client.Cgroup})-cl0, cgroupsCPU([]string{p.server.Cgroup})-sv0
	if v.trace {
		tr := e.stopTrace()
		r.events, r.lost = tr.Events, tr.lost()
		if r.events+r.lost < r.Conns {
			e.t.Fatalf("%s %s: %d connections, but the tracer saw %d events and lost %d (%s)", req.Op, v.name, r.Conns, r.events, r.lost, tr.Summary)
		}
	}
	var relayErrs int64
	var lastErr string
	if zt := e.ztCounts(); p.name == pathDirect && (zt.Outbound != zt0.Outbound || zt.Inbound != zt0.Inbound) {
		e.t.Fatalf("%s on %s: connections went through the stand-in", req.Op, v.name)
	}
	switch {
	case v.proxied:
		out, in := e.leanCounts(p.client), e.leanCounts(p.server)
		if got := out.Outbound - out0.Outbound; got < r.Conns {
			e.t.Fatalf("%s on %s: %d connections, but the lean proxy accepted %d outbound in the client pod", req.Op, v.name, r.Conns, got)
		}
		if got := in.Inbound - in0.Inbound; got < r.Conns {
			e.t.Fatalf("%s on %s: %d connections, but the lean proxy accepted %d inbound in the server pod", req.Op, v.name, r.Conns, got)
		}
		relayErrs = out.Errors - out0.Errors + in.Errors - in0.Errors
		lastErr = strings.TrimSpace(out.LastError + " " + in.LastError)
	case p.name != pathDirect:
		e.t.Fatalf("%s: a meshed path without lean proxies", v.name)
	}
	if !req.Storm && r.Failures*10 > r.Conns {
		e.t.Fatalf("%s on %s: %d of %d connections failed, the first: %s; the lean proxies' latest failures: %s",
			req.Op, v.name, r.Failures, r.Conns+r.Failures, r.FirstError, lastErr)
	}
	if !req.Storm && (r.Failures > 0 || relayErrs > 0) {
		f := e.failures[p.name]
		f.conns += r.Failures
		f.relay += relayErrs
		if f.first == "" {
			f.first = fmt.Sprintf("client: %s; lean proxy: %s", r.FirstError, lastErr)
		}
		e.failures[p.name] = f
		slog.Warn("connections failed", "path", v.name, "op", req.Op, "failures", r.Failures, "relay_errors", relayErrs, "first", r.FirstError)
	}
	if p.ebpf() {
		if got := e.dpStats(p.client).OutboundRedirects - dp0.OutboundRedirects; got < uint64(r.Conns) {
			e.t.Fatalf("%s on %s: %d connections, but the dataplane redirected %d", req.Op, v.name, r.Conns, got)
		}
	}
	return r
}

// startTrace has the tracer trace through the agent and waits until the
// programs' events are on.
func (e *env) startTrace() {
	e.t.Helper()
	if err := call(e.tracer, tracerRequest{Op: "start", BPFFS: e.node.BPFFSDir, Inspect: e.agent.Inspect}, nil); err != nil {
		e.t.Fatalf("start tracing: %v", err)
	}
	e.waitTrace(true)
}

// stopTrace ends the trace and waits until the events are off again.
func (e *env) stopTrace() tracerResult {
	e.t.Helper()
	var tr tracerResult
	if err := call(e.tracer, tracerRequest{Op: "stop"}, &tr); err != nil {
		e.t.Fatalf("stop tracing: %v", err)
	}
	e.waitTrace(false)
	return tr
}

func (e *env) waitTrace(on bool) {
	e.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		got, _, err := inspect.TraceState(e.node.BPFFSDir)
		if err == nil && got == on {
			return
		}
		if time.Now().After(deadline) {
			if on {
				var tr tracerResult
				stopErr := call(e.tracer, tracerRequest{Op: "stop"}, &tr)
				e.t.Fatalf("tracing did not come on (%v); the tracer: %v %s", err, stopErr, tr.Summary)
			}
			e.t.Fatalf("tracing did not go off (%v)", err)
		}
	}
}

// lost parses the tracer's summary ("N events, M lost").
func (r tracerResult) lost() int64 {
	var n, m int64
	if _, err := fmt.Sscanf(r.Summary, "%d events, %d lost", &n, &m); err != nil {
		return 0
	}
	return m
}

// cgroupsCPU sums the cgroups' usage_usec (cpu.stat, kept by the kernel
// for every cgroup v2 whether or not the cpu controller is enabled).
func cgroupsCPU(cgs []string) time.Duration {
	var total time.Duration
	for _, cg := range cgs {
		b, err := os.ReadFile(filepath.Join(cg, "cpu.stat"))
		if err != nil {
			continue
		}
		for l := range strings.Lines(string(b)) {
			if rest, ok := strings.CutPrefix(l, "usage_usec "); ok {
				v, _ := strconv.ParseInt(strings.TrimSpace(rest), 10, 64)
				total += time.Duration(v) * time.Microsecond
			}
		}
	}
	return total
}

// softirqThreads finds the ksoftirqd threads, one per CPU.
func softirqThreads() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, d := range ents {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err == nil && bytes.HasPrefix(comm, []byte("ksoftirqd/")) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// threadsCPU is the CPU time of the threads so far (the first field of
// /proc/<pid>/schedstat, in ns).
func threadsCPU(pids []int) time.Duration {
	var total time.Duration
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			v, _ := strconv.ParseInt(f[0], 10, 64)
			total += time.Duration(v)
		}
	}
	return total
}

// unknownFlags returns the flags (names before any "=") the agent binary
// does not list in its --help (which the flag package prints as
// "  -name type").
func (a *nodeAgent) unknownFlags(flags []string) []string {
	out, _ := exec.Command(a.Bin, "--help").CombinedOutput()
	var missing []string
	for _, f := range flags {
		name, _, _ := strings.Cut(strings.TrimLeft(f, "-"), "=")
		if !bytes.Contains(out, []byte("-"+name+" ")) && !bytes.Contains(out, []byte("-"+name+"\n")) {
			missing = append(missing, f)
		}
	}
	return missing
}
