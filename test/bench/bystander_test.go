// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// A bystander is a socket of what is not in the mesh: a pod the agent
// does not enrol, or a process of the node netns (kubelet, host daemons).
// The agent's socket programs sit on the pods' cgroup and the node's root,
// so they run for bystanders too (issue 35); istio-cni charges them
// nothing. bystander measures what they charge.
//
// Each kind runs as two pairs on the same node, alternating in every
// repetition: one in the cgroups the agent's programs are attached to (a
// pod's below the pods' cgroup, or beside the agent below the node's
// root), one in a cgroup outside the node's root, where none of ours run:
// what that pair measures is the node without the agent. Not enrolled,
// bystander pods have none of the agent's tc or sk_lookup programs either.
type bystanderPair struct {
	kind   string // pod or node
	hooked bool
	addr   string
	gen    *simnode.Proc
	cgs    []string // the client's and the server's cgroups
}

// bystanderBase is the node pairs' server port (echo; sink is +1): the
// hooked pair's, and the other's 100 above (both listen in the node netns).
const bystanderBase = 18080

func (e *env) bystanderPairs() []*bystanderPair {
	t, n := e.t, e.node
	outside := n.CgroupRoot + "-bystanders"
	if err := os.Mkdir(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	// Removed after the helpers in it are ended (cleanups run in reverse).
	t.Cleanup(func() {
		for _, d := range []string{"pod-c", "pod-s", "perpod-c", "perpod-s", "node-c", "node-s", "floor/c", "floor/s", "floor", ""} {
			if err := unix.Rmdir(filepath.Join(outside, d)); err != nil && !os.IsNotExist(err) {
				t.Errorf("cleanup: remove cgroup %s: %v", filepath.Join(outside, d), err)
			}
		}
	})
	var pairs []*bystanderPair
	for _, hooked := range []bool{false, true} {
		// Pods, as the direct pair is set up: below the pods' cgroup, and
		// with --socket-hooks=pods, where a pod outside the mesh meets
		// only the root's programs: what a pair in cgroups below the root
		// but outside the pods' cgroup meets with these shared hooks.
		for _, kind := range []string{"pod", "perpod"} {
			c, s := n.AddPod(fmt.Sprintf("by%v-%s-c", hooked, kind)), n.AddPod(fmt.Sprintf("by%v-%s-s", hooked, kind))
			for _, pod := range []*simnode.Pod{c, s} {
				n.Sysctl(pod.NS, "net/ipv4/tcp_tw_reuse", "1")
			}
			n.Sysctl(s.NS, "net/ipv4/tcp_max_tw_buckets", "0")
			n.Sysctl(c.NS, "net/ipv4/ip_local_port_range", "32768 46999")
			n.Sysctl(s.NS, "net/ipv4/ip_local_port_range", "47000 60999")
			ccg, scg := c.Cgroup, s.Cgroup
			switch {
			case !hooked:
				ccg, scg = e.cgroupIn(outside, kind+"-c"), e.cgroupIn(outside, kind+"-s")
			case kind == "perpod":
				ccg, scg = e.cgroup("by-perpod-c"), e.cgroup("by-perpod-s")
			}
			srv := simnode.StartHelper(t, roleServer, s.NS, scg)
			if err := call(srv, serverRequest{Op: "listen"}, nil); err != nil {
				t.Fatalf("bystander server in %s: %v", s.Name, err)
			}
			gen := simnode.StartHelper(t, roleClient, c.NS, ccg)
			e.pinPair(gen, srv)
			pairs = append(pairs, &bystanderPair{kind: kind, hooked: hooked, addr: fmt.Sprintf("%s:%d", s.V4, echoPort),
				gen: gen, cgs: []string{ccg, scg}})
		}

		// Node processes, over the node's loopback.
		ncg, nscg, base := e.cgroup(fmt.Sprintf("by%v-node-c", hooked)), e.cgroup(fmt.Sprintf("by%v-node-s", hooked)), bystanderBase
		if !hooked {
			ncg, nscg, base = e.cgroupIn(outside, "node-c"), e.cgroupIn(outside, "node-s"), bystanderBase+100
		}
		nsrv := simnode.StartHelper(t, roleServer, n.NodeNS, nscg)
		if err := call(nsrv, serverRequest{Op: "listen", Base: base}, nil); err != nil {
			t.Fatalf("bystander server in the node netns: %v", err)
		}
		ngen := simnode.StartHelper(t, roleClient, n.NodeNS, ncg)
		e.pinPair(ngen, nsrv)
		pairs = append(pairs, &bystanderPair{kind: "node", hooked: hooked, addr: fmt.Sprintf("127.0.0.1:%d", base),
			gen: ngen, cgs: []string{ncg, nscg}})
	}
	return pairs
}

// floorPair is a node pair like the others, in cgroups outside the node's
// root below one that holds a connect4 and a sockops program returning at
// once: the hooks the node-wide half of a split attach uses. Its run time
// per connection is what the kernel's calls of those hooks cost, whatever
// the programs do (BPF_ENABLE_STATS' own clock reads included, as in
// every bpf_ns figure): the floor under the node-wide half's figures.
func (e *env) floorPair() (*bystanderPair, []*ebpf.Program) {
	t, n := e.t, e.node
	floor := e.cgroupIn(n.CgroupRoot+"-bystanders", "floor")
	c, s := e.cgroupIn(floor, "c"), e.cgroupIn(floor, "s")
	var progs []*ebpf.Program
	for _, h := range []struct {
		typ    ebpf.ProgramType
		attach ebpf.AttachType
	}{{ebpf.CGroupSockAddr, ebpf.AttachCGroupInet4Connect}, {ebpf.SockOps, ebpf.AttachCGroupSockOps}} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: "floor", Type: h.typ, AttachType: h.attach, License: "Dual BSD/GPL",
			Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()}})
		if err != nil {
			t.Fatalf("load an empty %v program: %v", h.attach, err)
		}
		t.Cleanup(func() { prog.Close() })
		l, err := link.AttachCgroup(link.CgroupOptions{Path: floor, Attach: h.attach, Program: prog})
		if err != nil {
			t.Fatalf("attach an empty %v program to %s: %v", h.attach, floor, err)
		}
		t.Cleanup(func() { l.Close() })
		progs = append(progs, prog)
	}
	base := bystanderBase + 200
	srv := simnode.StartHelper(t, roleServer, n.NodeNS, s)
	if err := call(srv, serverRequest{Op: "listen", Base: base}, nil); err != nil {
		t.Fatalf("floor server in the node netns: %v", err)
	}
	gen := simnode.StartHelper(t, roleClient, n.NodeNS, c)
	e.pinPair(gen, srv)
	return &bystanderPair{kind: "floor", hooked: true, addr: fmt.Sprintf("127.0.0.1:%d", base), gen: gen, cgs: []string{c, s}}, progs
}

// pinPair binds every thread of a pair's client to the first CPU and of
// its server to the last (threads made later inherit it). Left to the
// scheduler, a round trip took either about 23 us or about 55 us
// depending on where the two landed, whichever pair it was: the pairs'
// rr figures differed by 2.5x, hooked or not, in the order they ran.
func (e *env) pinPair(client, server *simnode.Proc) {
	e.pin(client, 0)
	e.pin(server, runtime.NumCPU()-1)
}

// pin binds every thread of proc to the CPUs (threads made later
// inherit it); with none, to every CPU again.
func (e *env) pin(proc *simnode.Proc, cpus ...int) {
	var set unix.CPUSet
	if len(cpus) == 0 {
		for cpu := range runtime.NumCPU() {
			set.Set(cpu)
		}
	}
	for _, cpu := range cpus {
		set.Set(cpu)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", proc.PID()))
	if err != nil {
		e.t.Fatal(err)
	}
	for _, task := range tasks {
		tid, _ := strconv.Atoi(task.Name())
		if err := unix.SchedSetaffinity(tid, &set); err != nil {
			e.t.Fatalf("pin thread %d of %d to CPUs %v: %v", tid, proc.PID(), cpus, err)
		}
	}
}

// column is the pair's column in the timed figures: direct for the node
// without the agent, ebpf with its programs, direct+floor for the floor
// pair (the node without the agent, its pair below two programs that
// return at once).
func (p *bystanderPair) column() string {
	switch {
	case p.kind == "floor":
		return variantFloor
	case p.hooked:
		return pathEBPF
	}
	return pathDirect
}

// figureKind is the kind whose timed figures carry the pair: the floor
// pair is a node pair.
func (p *bystanderPair) figureKind() string {
	if p.kind == "floor" {
		return "node"
	}
	return p.kind
}

// variantFloor is the floor pair's column in the node figures: what any
// connect4 and sockops program on the root costs a node connection,
// against which the ebpf column's difference is ours.
const variantFloor = "direct+floor"

// bystander runs, in every repetition and for both kinds, each pair's
// conn_rate_seq (with the CPU of its two cgroups and ksoftirqd per
// connection) and rr latency, alternating hooked and not; then, with the
// kernel's BPF run-time statistics on (BPF_ENABLE_STATS, which adds its
// own clock reads, so never during the timed runs), one more connection
// run of each hooked pair: the run time of every program attached to the
// node's root and the pods' cgroup, per connection.
func (e *env) bystander(res *Results) {
	s := e.s
	pairs := e.bystanderPairs()
	floor, floorProgs := e.floorPair()
	e.measureBystander(floor, loadRequest{Op: "conn", Addr: floor.addr, Duration: 200 * time.Millisecond})
	for _, p := range pairs {
		e.measureBystander(p, loadRequest{Op: "conn", Addr: p.addr, Duration: 200 * time.Millisecond})
	}
	conns, cpu, p50, p99, bpfNs := map[string]map[string][]float64{}, map[string]map[string][]float64{},
		map[string]map[string][]float64{}, map[string]map[string][]float64{}, map[string]map[string][]float64{}
	add := func(m map[string]map[string][]float64, kind, column string, v float64) {
		if m[kind] == nil {
			m[kind] = map[string][]float64{}
		}
		m[kind][column] = append(m[kind][column], v)
	}
	// The floor pair runs its timed figures as a column of the node's.
	timed := append(slices.Clone(pairs), floor)
	for rep := range s.reps {
		// Hooked first in every other repetition: neither side always
		// runs on a machine the other just warmed.
		slices.Reverse(timed)
		for _, p := range timed {
			r, c := e.measureBystander(p, loadRequest{Op: "conn", Addr: p.addr, Duration: s.duration})
			add(conns, p.figureKind(), p.column(), rate(run{loadResult: r}))
			add(cpu, p.figureKind(), p.column(), us(c)/float64(max(r.Conns, 1)))
		}
		for _, p := range timed {
			r, _ := e.measureBystander(p, loadRequest{Op: "rr", Addr: p.addr, Count: s.rtts})
			add(p50, p.figureKind(), p.column(), us(percentile(r.RTTs, 50)))
			add(p99, p.figureKind(), p.column(), us(percentile(r.RTTs, 99)))
		}
		stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
		if err != nil {
			e.t.Fatalf("enable BPF run-time statistics: %v", err)
		}
		for _, p := range pairs {
			if !p.hooked {
				continue
			}
			before := e.ourRuns()
			r, _ := e.measureBystander(p, loadRequest{Op: "conn", Addr: p.addr, Duration: s.duration})
			after := e.ourRuns()
			var d time.Duration
			for k, v := range after {
				d += v.runtime - before[k].runtime
			}
			add(bpfNs, p.kind, pathEBPF, float64(d)/float64(max(r.Conns, 1)))
			res.Notes["bystander "+p.kind+": per connection, each program attached to the node's root or the pods' cgroup, or at tcp_connect (last repetition)"] =
				runsNote(before, after, max(r.Conns, 1))
		}
		before := floorRuns(e.t, floorProgs)
		r, _ := e.measureBystander(floor, loadRequest{Op: "conn", Addr: floor.addr, Duration: s.duration})
		after := floorRuns(e.t, floorProgs)
		var d time.Duration
		for k, v := range after {
			d += v.runtime - before[k].runtime
		}
		add(bpfNs, floor.kind, pathEBPF, float64(d)/float64(max(r.Conns, 1)))
		res.Notes["bystander floor: per connection, each empty program (last repetition)"] = runsNote(before, after, max(r.Conns, 1))
		stats.Close()
		slog.Info("bystander repetition done", "rep", rep+1, "of", s.reps)
	}
	how := "direct: a pair in cgroups outside the node's root (none of the agent's programs run), ebpf: the same kind of pair in " +
		"the cgroups the agent's programs are attached to; alternating in every repetition; "
	for _, kind := range []string{"pod", "perpod", "node"} {
		what := map[string]string{"pod": "two pods the agent does not enrol, client to server over the node",
			"perpod": "two pods the agent does not enrol, as with --socket-hooks=pods (where such a pod meets only the programs on the node's root): " +
				"the ebpf pair in cgroups below the node's root, outside the pods' cgroup; client to server over the node",
			"node": "two processes of the node netns, over its loopback; direct+floor: the same in cgroups outside the node's root " +
				"below one holding a connect4 and a sockops program that return at once (bystander_floor_bpf_ns), alternating with the others"}[kind]
		res.Figures = append(res.Figures,
			newFigure("bystander_"+kind+"_conn_rate", "conn/s", "higher", "ebpf/direct >= 0.99", conns[kind]).WithNote(how+what+"; conn_rate_seq"),
			newFigure("bystander_"+kind+"_conn_cpu_us", "us CPU/conn", "lower", "ebpf/direct <= 1.01", cpu[kind]).WithNote(
				how+what+"; CPU time of the client's and the server's cgroups and the ksoftirqd threads during conn_rate_seq, per connection"),
			newFigure("bystander_"+kind+"_rr_p50", "us", "lower", "ebpf/direct <= 1.01", p50[kind]).WithNote(how+what),
			newFigure("bystander_"+kind+"_rr_p99", "us", "lower", "ebpf/direct <= 1.01", p99[kind]).WithNote(how+what),
			newFigure("bystander_"+kind+"_bpf_ns", "ns/conn", "lower", "<= 500", bpfNs[kind]).WithNote(
				what+"; the run time (BPF_ENABLE_STATS) of every program attached to the node's root and the pods' cgroup, and of the "+
					"host-probe program at tcp_connect, during a conn_rate_seq run of the hooked pair, per connection (both ends)"),
		)
	}
	res.Figures = append(res.Figures, newFigure("bystander_floor_bpf_ns", "ns/conn", "lower", "", bpfNs["floor"]).WithNote(
		"two processes of the node netns, over its loopback, in cgroups outside the node's root below one holding a connect4 and a "+
			"sockops program that return at once (the hooks of the node-wide half): the run time (BPF_ENABLE_STATS) of the two per "+
			"connection (both ends), what the kernel's calls cost whatever a program does"))
}

// floorRuns is the run time and count so far of the floor's programs.
func floorRuns(t interface{ Fatalf(string, ...any) }, progs []*ebpf.Program) map[string]progRun {
	out := map[string]progRun{}
	for i, p := range progs {
		st, err := p.Stats()
		if err != nil {
			t.Fatalf("floor program stats: %v", err)
		}
		out[fmt.Sprintf("floor/%s", []string{"connect4", "sockops"}[i])] = progRun{st.Runtime, st.RunCount}
	}
	return out
}

// measureBystander runs req on the pair's client and returns the result
// and the CPU time of the pair's cgroups and ksoftirqd while it ran.
func (e *env) measureBystander(p *bystanderPair, req loadRequest) (loadResult, time.Duration) {
	e.t.Helper()
	cpu0, sirq0 := cgroupsCPU(p.cgs), threadsCPU(e.softirqd)
	var r loadResult
	if err := call(p.gen, req, &r); err != nil {
		e.t.Fatalf("bystander %s (%s): %s %s: %v", p.kind, p.column(), req.Op, req.Addr, err)
	}
	cpu := cgroupsCPU(p.cgs) - cpu0 + threadsCPU(e.softirqd) - sirq0
	if r.Failures*10 > r.Conns {
		e.t.Fatalf("bystander %s (%s): %d of %d connections failed, the first: %s", p.kind, p.column(), r.Failures, r.Conns+r.Failures, r.FirstError)
	}
	return r, cpu
}

// cgroupHooks are the cgroup attach points the agent may use.
var cgroupHooks = []ebpf.AttachType{
	ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect, ebpf.AttachCGroupUDP4Sendmsg, ebpf.AttachCGroupUDP6Sendmsg,
	ebpf.AttachCGroupUDP4Recvmsg, ebpf.AttachCGroupUDP6Recvmsg, ebpf.AttachCgroupInet4GetPeername, ebpf.AttachCgroupInet6GetPeername,
	ebpf.AttachCGroupGetsockopt, ebpf.AttachCGroupSetsockopt, ebpf.AttachCGroupSockOps, ebpf.AttachCGroupInet4PostBind,
	ebpf.AttachCGroupInet6PostBind, ebpf.AttachCGroupInetSockCreate, ebpf.AttachCGroupInet4Bind, ebpf.AttachCGroupInet6Bind,
	ebpf.AttachCgroupInetSockRelease, ebpf.AttachCGroupInetIngress, ebpf.AttachCGroupInetEgress,
}

// progRun is a program's run time and run count so far.
type progRun struct {
	runtime time.Duration
	count   uint64
}

// ourRuns is the run time and count so far of every program attached
// to the node's root cgroup and the pods' cgroup, and of the host-probe
// program on tcp_connect (BPF_ENABLE_STATS on), by "<where>/<program>(<id>)".
func (e *env) ourRuns() map[string]progRun {
	e.t.Helper()
	type attached struct {
		id    ebpf.ProgramID
		where string
	}
	var ids []attached
	for _, dir := range []string{e.node.CgroupRoot, e.node.PodsCgroup} {
		f, err := os.Open(dir)
		if err != nil {
			e.t.Fatal(err)
		}
		for _, a := range cgroupHooks {
			q, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: a})
			if err != nil {
				continue // a hook this kernel does not have
			}
			for _, p := range q.Programs {
				ids = append(ids, attached{p.ID, filepath.Base(dir)})
			}
		}
		f.Close()
	}
	// bpf/probe.c's program runs at every TCP connect of the node, from
	// whichever cgroup: attached by a pinned fentry link, not to a cgroup.
	if prog, err := pinnedProgram(filepath.Join(e.node.BPFFSDir, "links", bpfobj.ProbeConnectPin)); err == nil {
		if info, err := prog.Info(); err == nil {
			if id, ok := info.ID(); ok {
				ids = append(ids, attached{id, "tcp_connect"})
			}
		}
		prog.Close()
	}
	out := map[string]progRun{}
	for _, a := range ids {
		prog, err := ebpf.NewProgramFromID(a.id)
		if err != nil {
			continue // detached meanwhile
		}
		st, err := prog.Stats()
		var name string
		if info, err := prog.Info(); err == nil {
			name = info.Name
		}
		prog.Close()
		if err != nil {
			e.t.Fatalf("program %d: %v", a.id, err)
		}
		out[fmt.Sprintf("%s/%s(%d)", a.where, name, a.id)] = progRun{st.Runtime, st.RunCount}
	}
	return out
}

// runsNote says, per program, its run time and runs per connection
// between two ourRuns readings.
func runsNote(before, after map[string]progRun, conns int64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(after)) {
		d := after[k].runtime - before[k].runtime
		n := after[k].count - before[k].count
		if n == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %.0f ns, %.1f runs", k, float64(d)/float64(conns), float64(n)/float64(conns)))
	}
	return strings.Join(parts, "; ")
}
