// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func TestMain(m *testing.M) {
	RunHelper()
	// The profiles name our functions: the agent and the plugin keep
	// their symbols (not loaded, so their execs cost the same).
	os.Setenv(testbin.SymbolsEnv, "1")
	os.Exit(m.Run())
}

// EnableEnv must be 1 for TestBench to run.
const EnableEnv = "AMBIENT_EBPF_BENCH"

// settings are the knobs of a run, from the environment.
type settings struct {
	reps       int           // BENCH_REPS: repetitions per path
	duration   time.Duration // BENCH_DURATION: one connection-rate or throughput run
	conc       int           // BENCH_CONC: parallel loops of conn_rate_conc
	rtts       int           // BENCH_RTTS: round trips per latency run
	enrollPods int           // BENCH_ENROLL_PODS: pods per path and repetition
	scalePods  int           // BENCH_SCALE_PODS
	churnReps  int           // BENCH_CHURN_REPS: churn runs per path
	results    string        // BENCH_RESULTS: path of results.json
	doc        string        // BENCH_DOC: path of BENCHMARKS.md
	readme     string        // BENCH_README: path of the README ("-": none)
	chart      string        // BENCH_CHART: path of the chart (SVG)
	// parts are the parts of the run (BENCH_PARTS, comma-separated; all
	// by default): traffic, lean, bystander, churn, profile, enroll, scale. "render"
	// alone measures nothing: it writes the doc's section and the chart
	// from an existing results.json.
	parts map[string]bool
	// BENCH_EXPOSE_COLLISIONS=1 has the server close connections first
	// and leaves both pods of a path the same ephemeral port range, which
	// exposes the eBPF path's 4-tuple collisions (docs/BENCHMARKS.md):
	// the run then fails.
	exposeCollisions bool
}

func loadSettings() settings {
	s := settings{reps: 5, duration: 1500 * time.Millisecond, conc: 8, rtts: 3000, enrollPods: 30, scalePods: 1000, churnReps: 3,
		results: "../../bench/results.json", doc: "../../docs/BENCHMARKS.md", readme: "../../README.md", chart: "../../bench/chart.svg", parts: map[string]bool{}}
	envInt := func(key string, v *int) {
		if n, err := strconv.Atoi(os.Getenv(key)); err == nil && n > 0 {
			*v = n
		}
	}
	envInt("BENCH_REPS", &s.reps)
	envInt("BENCH_CONC", &s.conc)
	envInt("BENCH_RTTS", &s.rtts)
	envInt("BENCH_ENROLL_PODS", &s.enrollPods)
	envInt("BENCH_SCALE_PODS", &s.scalePods)
	envInt("BENCH_CHURN_REPS", &s.churnReps)
	if d, err := time.ParseDuration(os.Getenv("BENCH_DURATION")); err == nil && d > 0 {
		s.duration = d
	}
	s.exposeCollisions = os.Getenv("BENCH_EXPOSE_COLLISIONS") == "1"
	if v := os.Getenv("BENCH_RESULTS"); v != "" {
		s.results = v
	}
	if v := os.Getenv("BENCH_DOC"); v != "" {
		s.doc = v
	}
	if v := os.Getenv("BENCH_README"); v != "" {
		s.readme = strings.TrimPrefix(v, "-")
	}
	if v := os.Getenv("BENCH_CHART"); v != "" {
		s.chart = v
	}
	parts := allParts
	if v := os.Getenv("BENCH_PARTS"); v != "" {
		parts = strings.Split(v, ",")
	}
	for _, p := range parts {
		s.parts[strings.TrimSpace(p)] = true
	}
	return s
}

// allParts are the parts of a full run, in the order they run.
var allParts = []string{"traffic", "lean", "bystander", "churn", "profile", "enroll", "scale"}

// partList names the parts a run measured.
func (s settings) partList() string {
	var out []string
	for _, p := range allParts {
		if s.parts[p] {
			out = append(out, p)
		}
	}
	if len(out) == len(allParts) {
		return "all (" + strings.Join(out, ", ") + ")"
	}
	return strings.Join(out, ", ") + " (BENCH_PARTS; the others were not run)"
}

// TestBench runs every measurement on one simulated node and writes
// bench/results.json and the table of docs/BENCHMARKS.md. It fails only on
// errors (including a meshed path that did not go through ztunnel), never
// on a number.
func TestBench(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("benchmarks run with %s=1 (make bench)", EnableEnv)
	}
	s := loadSettings()
	if s.parts["render"] {
		res, err := benchdoc.ReadJSON(s.results)
		if err != nil {
			t.Fatalf("render: %v", err)
		}
		if err := writeDoc(s.doc, s.readme, res); err != nil {
			t.Fatalf("write doc: %v", err)
		}
		if err := writeChart(s.chart, res); err != nil {
			t.Fatalf("write chart: %v", err)
		}
		t.Logf("rendered %s into %s and %s", s.results, s.doc, s.chart)
		return
	}
	e := newEnv(t, s)
	res := &Results{Machine: describeMachine(), Notes: map[string]string{}, Config: map[string]string{
		"repetitions":       strconv.Itoa(s.reps),
		"run duration":      s.duration.String(),
		"concurrent loops":  strconv.Itoa(s.conc),
		"round trips":       strconv.Itoa(s.rtts),
		"enrollments":       fmt.Sprintf("%d pods per path and repetition", s.enrollPods),
		"scale pods":        strconv.Itoa(s.scalePods),
		"traffic":           "IPv4, client pod to server pod on the same node; meshed: both pods enrolled (outbound and inbound capture, two relays: the stand-in's, or the lean proxy's on the lean paths)",
		"dns capture":       "on for both backends, Istio's default: the iptables pods' rules include istio-cni's DNS rules (nat REDIRECT to 15053, raw CT zone 1), the agent enrolls with its default --dns-capture=true (checked in the pinned pod options); the benchmark sends no DNS",
		"lean proxy":        "test/bench/leanproxy.go: one process in the node netns serving every lean pod (as ztunnel), one thread, level-triggered epoll, read/write relay; per pod listeners [::]:15001 and [::]:15006 with SO_MARK 0x539, SO_REUSEPORT, IP_TRANSPARENT; SO_ORIGINAL_DST on every accepted connection; upstream marked 0x539 and made in the pod's netns, inbound bound to the client's address; direct+proxy: the direct pods through the same proxy addressed explicitly (15101 -> 15106 -> server); direct+transparent: the same (15201 -> 15206 -> server) with SO_ORIGINAL_DST asked (and refused) and the inbound upstream bound to the client's address, its replies brought back by a policy route in the server pod (to the client, TCP, the server pod's ephemeral ports: a local route on lo)",
		"parts":             s.partList(),
		"connection close":  map[bool]string{false: "client first; tcp_tw_reuse=1 in the pods, no TIME_WAIT in server pods (tcp_max_tw_buckets=0); ephemeral ports 32768-46999 in client pods, 47000-60999 in server pods (see below)", true: "server first, shared ephemeral port range (BENCH_EXPOSE_COLLISIONS=1)"}[s.exposeCollisions],
		"ztunnel stand-in":  "test/ztunnel/standin (Go, a read/write relay per direction: splice would miss bytes the sockmap acceleration redirects), one process serving both meshed paths",
		"enrollment timing": "enroll_cni: exec of the CNI plugin (ebpf: cmd/ambient-ebpf-cni through the node agent; iptables: test/reference/iptables-cni; enroll_cni_istiocni: the real istio-cni's plugin through its node agent) to its exit 0 and redirection in place; enroll_latency: ebpf: dataplane.Enroll in a process of its own, iptables: istio-cni's rules applied with iptables-restore, ip rule/route and ipset commands (test/reference)",
		"node agent":        "cmd/ambient-ebpf-agent, standalone (pod file), its ZDS peer a client that acks every request at once",
		"scale concurrency": fmt.Sprintf("%d CNI calls in flight", scaleConc),
	}}
	res.Commit = gitCommit()
	start := time.Now()
	for _, part := range []struct {
		name string
		run  func(*Results)
	}{{"traffic", e.traffic}, {"lean", e.lean}, {"bystander", e.bystander}, {"churn", e.churn}, {"profile", e.profile}, {"enroll", e.enrollment}, {"scale", e.scale}} {
		if s.parts[part.name] {
			part.run(res)
			slog.Info(part.name+" done", "elapsed", time.Since(start).Round(time.Second))
		}
	}
	res.Config["total bench time"] = time.Since(start).Round(time.Second).String()
	for _, name := range slices.Concat(allPaths, leanPaths[1:]) {
		if f, ok := e.failures[name]; ok {
			res.Notes["failed connections, "+name] = fmt.Sprintf("%d at the client, %d the proxy (stand-in or lean) could not relay; first: %s", f.conns, f.relay, f.first)
		}
	}

	if err := benchdoc.WriteJSON(s.results, res); err != nil {
		t.Fatalf("write results: %v", err)
	}
	if err := writeDoc(s.doc, s.readme, res); err != nil {
		t.Fatalf("write doc: %v", err)
	}
	if err := writeChart(s.chart, res); err != nil {
		t.Fatalf("write chart: %v", err)
	}
	t.Logf("results in %s, %s and %s:\n%s", s.results, s.doc, s.chart, benchdoc.Markdown(res))
	e.teardown()
}

// env is the simulated node of a run: a client and a server pod per path,
// the ztunnel stand-in serving the iptables and the eBPF pods, the node
// agent owning the node's dataplane, the container runtime's side of CNI,
// and a dataplane of its own for timing the dataplane API.
type env struct {
	t     *testing.T
	s     settings
	node  *simnode.Node
	ipt   reference.Iptables
	agent *nodeAgent
	zt    *simnode.Proc
	// runtime execs the CNI plugins (cniRuntime).
	runtime *simnode.Proc
	// ebpfList and iptablesList are the conflists it execs from: the
	// installer's, and the same with iptables-cni in our plugin's place.
	ebpfList, iptablesList []byte
	// dpapi owns the dataplane of dpCfg (agent), for enroll_latency.
	dpapi *simnode.Proc
	dpCfg dataplane.Config
	paths map[string]*path
	// tracer is someone tracing the node (ambient-ebpf trace through the
	// agent), for the ebpf+trace variant of the lean paths.
	tracer   *simnode.Proc
	tracerCG string
	// leanpx is the lean proxy serving the lean paths' pods (ztunnel's
	// listeners) and the direct pods (explicit ones, direct+proxy and direct+transparent), in
	// cgroup leanCG.
	leanpx *simnode.Proc
	leanCG string
	// softirqd are the ksoftirqd threads, whose CPU time the lean
	// figures count.
	softirqd []int
	light    *lightPods // pods without apps, for enrollment and scale
	// istio is the real istio-cni's node, for the enrolment figures
	// (started by enrollment; nil without the istiocnireal tag).
	istio *istioCNI
	// cniPods (per repetition, and one batch more) and scalePods are the
	// pods the node agent enrolls through the CNI plugin: its pod file
	// names them.
	cniPods   [][]*simnode.Pod
	scalePods []*simnode.Pod
	// failures are the connections that failed, by path: reported, not
	// fatal unless there are many.
	failures map[string]failures
}

// failures tallies failed connections of one path.
type failures struct {
	conns int64  // failed at the client
	relay int64  // the stand-in could not relay
	first string // the first failure
}

// path is one of direct, iptables, ebpf (through the stand-in),
// iptables-lean and ebpf-lean (through lean proxies): a client pod running
// the load generator and a server pod.
type path struct {
	name           string
	client, server *simnode.Pod
	gen, srv       *simnode.Proc // load generator, server
	echo, sink     string        // server addresses
}

// iptables and ebpf tell the backend of a meshed path.
func (p *path) iptables() bool { return p.name == pathIptables || p.name == pathIptablesLean }
func (p *path) ebpf() bool     { return p.name == pathEBPF || p.name == pathEBPFLean }

func newEnv(t *testing.T, s settings) *env {
	n := simnode.New(t)
	e := &env{t: t, s: s, node: n, paths: map[string]*path{}, failures: map[string]failures{}}
	for _, name := range slices.Concat(allPaths, leanPaths[1:]) {
		p := &path{name: name, client: n.AddPod(name + "-c"), server: n.AddPod(name + "-s")}
		e.paths[name] = p
		for _, pod := range []*simnode.Pod{p.client, p.server} {
			// Thousands of connections a second leave ports in
			// TIME_WAIT on the connecting sides; reuse them (after 1 s)
			// as busy proxies and clients do.
			n.Sysctl(pod.NS, "net/ipv4/tcp_tw_reuse", "1")
		}
		// The stand-in binds its inbound upstream sockets to the client's
		// address with port 0; with the server pod's port range full of
		// TIME_WAIT sockets that bind's port search dominated the
		// stand-in (perf: inet_csk_get_port, bhash2 conflict checks) and
		// meshed rates fell from one repetition to the next. Only the
		// stand-in's sockets close first in a server pod.
		if !s.exposeCollisions {
			n.Sysctl(p.server.NS, "net/ipv4/tcp_max_tw_buckets", "0")
			// Disjoint ephemeral ports for the two ends: see
			// docs/BENCHMARKS.md, "4-tuple collisions on the eBPF path".
			n.Sysctl(p.client.NS, "net/ipv4/ip_local_port_range", "32768 46999")
			n.Sysctl(p.server.NS, "net/ipv4/ip_local_port_range", "47000 60999")
		}
	}
	e.ipt.Setup(t, n)
	// ztunnel and the lean proxy standing in for it are pods on a node:
	// below the pods' cgroup, where the agent attaches (--pods-cgroup).
	e.zt = simnode.StartHelper(t, roleZtunnel, n.NodeNS, e.cgroupIn(n.PodsCgroup, "ztunnel"))
	e.light = newLightPods(t, n)

	// The node agent, its pod file naming every pod it will be asked
	// about; the stand-in's ZDS client connects to it.
	ebpf, ebpfLean := e.paths[pathEBPF], e.paths[pathEBPFLean]
	known := []*simnode.Pod{ebpf.client, ebpf.server, ebpfLean.client, ebpfLean.server}
	e.cniPods = make([][]*simnode.Pod, s.reps+1) // the last: a profiled batch
	for rep := range s.reps + 1 {
		e.cniPods[rep] = e.light.plan(fmt.Sprintf("c%d-", rep), s.enrollPods)
		known = append(known, e.cniPods[rep]...)
	}
	e.scalePods = e.light.plan("s", s.scalePods)
	e.agent = newNodeAgent(t, n, e.cgroup("agent"), append(known, e.scalePods...))
	e.agent.start()
	e.ebpfList, e.iptablesList = e.agent.conflists()
	if err := call(e.zt, ztunnelRequest{Op: "zds", Socket: e.agent.ZDS}, nil); err != nil {
		t.Fatalf("connect to the agent over ZDS: %v", err)
	}
	e.agent.waitFor("ztunnel to connect", func(st cli.Status) bool { return st.Agent.ZtunnelConnections > 0 })
	e.runtime = simnode.StartHelper(t, roleRuntime, n.NodeNS, e.cgroup("runtime"))

	e.dpapi = simnode.StartHelper(t, roleAgent, n.NodeNS, e.cgroup("dpapi-agent"))
	e.dpCfg = dataplane.Config{BPFFSDir: filepath.Join(filepath.Dir(n.BPFFSDir), "dpapi"), CgroupRoot: e.cgroup("dpapi"),
		NodeNetns: simnode.NetnsPath(n.NodeNS)}
	if err := call(e.dpapi, agentRequest{Op: "new", Config: e.dpCfg}, nil); err != nil {
		t.Fatalf("load dataplane: %v", err)
	}

	e.tracerCG = e.cgroup("tracer")
	e.tracer = simnode.StartHelper(t, roleTracer, n.NodeNS, e.tracerCG)
	e.softirqd = softirqThreads()
	e.leanCG = e.cgroupIn(n.PodsCgroup, "lean")
	e.leanpx = simnode.StartHelper(t, roleLean, n.NodeNS, e.leanCG, "GOMAXPROCS=1")
	for _, name := range slices.Concat(allPaths, leanPaths[1:]) {
		p := e.paths[name]
		for _, pod := range []*simnode.Pod{p.client, p.server} {
			if name == pathIptables || name == pathEBPF {
				e.ztAdd(pod)
			}
			switch {
			case p.iptables():
				// DNS capture on, as istio-cni's default.
				e.ipt.Enroll(t, pod, podopts.Options{DNSCapture: true})
			case p.ebpf():
				if _, err := e.cni(pathEBPF, "ADD", []*simnode.Pod{pod}, 1); err != nil {
					t.Fatalf("CNI ADD %s: %v", pod.Name, err)
				}
				if ep := e.pinned()[pod.UID]; !ep.Options.DNSCapture {
					t.Fatalf("%s enrolled without DNS capture (options %+v): the agent's default is on", pod.Name, ep.Options)
				}
			}
		}
		if name == pathIptablesLean || name == pathEBPFLean || name == pathDirect {
			e.addLean(p)
		}
		p.srv = simnode.StartHelper(t, roleServer, p.server.NS, p.server.Cgroup)
		if err := call(p.srv, serverRequest{Op: "listen"}, nil); err != nil {
			t.Fatalf("start server in %s: %v", p.server.Name, err)
		}
		p.gen = simnode.StartHelper(t, roleClient, p.client.NS, p.client.Cgroup)
		p.echo = fmt.Sprintf("%s:%d", p.server.V4, echoPort)
		p.sink = fmt.Sprintf("%s:%d", p.server.V4, sinkPort)
	}
	if err := call(e.leanpx, leanRequest{Op: "serve"}, nil); err != nil {
		t.Fatalf("lean proxy: %v", err)
	}
	return e
}

// cgroup makes a cgroup below the node's root for a helper outside the
// pods; the node's cleanup removes it and ends what runs in it.
func (e *env) cgroup(name string) string { return e.cgroupIn(e.node.CgroupRoot, name) }

func (e *env) cgroupIn(parent, name string) string {
	cg := filepath.Join(parent, name)
	if err := os.Mkdir(cg, 0o755); err != nil {
		e.t.Fatal(err)
	}
	return cg
}

func (e *env) ztAdd(p *simnode.Pod) {
	if err := call(e.zt, ztunnelRequest{Op: "add", UID: p.UID, Netns: p.NetnsPath()}, nil); err != nil {
		e.t.Fatalf("ztunnel add %s: %v", p.Name, err)
	}
}

func dpPod(p *simnode.Pod) dataplane.Pod {
	return dataplane.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs()}
}

// enroll enrolls pods one after the other through the dataplane API.
func (e *env) enroll(pods []*simnode.Pod) (enrollResult, error) {
	req := agentRequest{Op: "enroll"}
	for _, p := range pods {
		req.Pods = append(req.Pods, dpPod(p))
	}
	var res enrollResult
	err := call(e.dpapi, req, &res)
	return res, err
}

func (e *env) remove(pods []*simnode.Pod) error {
	req := agentRequest{Op: "remove"}
	for _, p := range pods {
		req.UIDs = append(req.UIDs, p.UID)
	}
	return call(e.dpapi, req, nil)
}

// cni has the runtime exec the path's CNI plugin (ADD or DEL) for pods,
// conc calls in flight.
func (e *env) cni(path, command string, pods []*simnode.Pod, conc int) (cniResult, error) {
	req := cniRequest{Command: command, BinDir: e.agent.CNIBinDir, Conc: conc, Pods: toCNIPods(pods)}
	switch path {
	case pathEBPF:
		req.Conflist, req.Plugin, req.Check, req.BPFFS = e.ebpfList, plugin.PluginType, checkNetns, e.node.BPFFSDir
	case pathIptables:
		req.Conflist, req.Plugin, req.Check = e.iptablesList, iptablesPlugin, checkIptables
	case pathIstioCNI:
		return e.istio.cni(command, pods, conc)
	}
	var res cniResult
	if err := call(e.runtime, req, &res); err != nil {
		out := e.agent.Agent.Output.String()
		return res, fmt.Errorf("%w; the agent's latest output:\n%s", err, out[max(0, len(out)-4000):])
	}
	return res, nil
}

func (e *env) ztCounts() ztunnelCounts {
	var c ztunnelCounts
	if err := call(e.zt, ztunnelRequest{Op: "counts"}, &c); err != nil {
		e.t.Fatalf("ztunnel counts: %v", err)
	}
	return c
}

func (e *env) zdsCounts() zdsCounts { return zdsCountsOf(e.t, e.zt) }

// zdsCountsOf asks a ztunnel helper what its ZDS client received.
func zdsCountsOf(t testing.TB, zt *simnode.Proc) zdsCounts {
	var c zdsCounts
	if err := call(zt, ztunnelRequest{Op: "zds-counts"}, &c); err != nil {
		t.Fatalf("zds counts: %v", err)
	}
	return c
}

// pinnedView opens the node's pinned maps and lists their pods; the caller
// closes the view.
func (e *env) pinnedView() (*inspect.Pinned, []inspect.EnrolledPod) {
	e.t.Helper()
	view, err := inspect.OpenPinned(e.node.BPFFSDir)
	if err != nil {
		e.t.Fatalf("open pinned maps: %v", err)
	}
	pods, err := view.Pods()
	if err != nil {
		view.Close()
		e.t.Fatalf("pinned pods: %v", err)
	}
	return view, pods
}

// pinned returns the pods the node's pinned maps list, by UID.
func (e *env) pinned() map[string]inspect.EnrolledPod {
	view, pods := e.pinnedView()
	view.Close()
	out := map[string]inspect.EnrolledPod{}
	for _, p := range pods {
		out[p.UID] = p
	}
	return out
}

// dpStats reads a pod's counters from the node's pinned maps.
func (e *env) dpStats(p *simnode.Pod) inspect.Stats {
	e.t.Helper()
	view, pods := e.pinnedView()
	defer view.Close()
	i := slices.IndexFunc(pods, func(ep inspect.EnrolledPod) bool { return ep.UID == p.UID })
	if i < 0 {
		e.t.Fatalf("%s is not in the pinned maps", p.Name)
	}
	st, err := view.Stats(pods[i].Slot)
	if err != nil {
		e.t.Fatalf("dataplane stats of %s: %v", p.Name, err)
	}
	return st
}

// cpuTime is a process's user+system CPU time so far.
func cpuTime(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// Fields after the command's closing parenthesis; utime and stime
	// are fields 14 and 15 of the line, in clock ticks (100 Hz).
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// run is one measurement on one path, with proof of the path taken.
type run struct {
	loadResult
	ztCPU time.Duration // the stand-in's CPU time during the run
	// cpu is the CPU time of the client, the server and the stand-in
	// during the run, system calls (and the packet processing they
	// run) included.
	cpu time.Duration
}

// measure runs req on the path's load generator and checks that the
// connections took the path: through the stand-in (both hops) for the
// meshed paths, redirected by the dataplane for ebpf, and never through
// the stand-in for direct. A mismatch is an error, not a number.
func (e *env) measure(p *path, req loadRequest) run {
	e.t.Helper()
	req.ServerCloses = e.s.exposeCollisions
	before := e.ztCounts()
	var dpBefore inspect.Stats
	if p.name == pathEBPF {
		dpBefore = e.dpStats(p.client)
	}
	procs := []*simnode.Proc{e.zt, p.gen, p.srv}
	cpu0 := make([]time.Duration, len(procs))
	for i, pr := range procs {
		cpu0[i] = cpuTime(pr.PID())
	}
	var r run
	if err := call(p.gen, req, &r.loadResult); err != nil {
		e.t.Fatalf("%s %s on %s: %v (the stand-in's latest failure: %s)", req.Op, req.Addr, p.name, err, e.ztCounts().LastError)
	}
	for i, pr := range procs {
		d := cpuTime(pr.PID()) - cpu0[i]
		if pr == e.zt {
			r.ztCPU = d
		}
		r.cpu += d
	}
	after := e.ztCounts()
	out, in, errs := after.Outbound-before.Outbound, after.Inbound-before.Inbound, after.Errors-before.Errors
	switch {
	case p.name == pathDirect && (out != 0 || in != 0):
		e.t.Fatalf("%s on direct: %d outbound and %d inbound connections went through the stand-in", req.Op, out, in)
	case p.name != pathDirect && (out < r.Conns || in < r.Conns):
		e.t.Fatalf("%s on %s: %d connections, but the stand-in saw %d outbound and %d inbound", req.Op, p.name, r.Conns, out, in)
	case r.Failures*10 > r.Conns:
		// A rare failure is a finding to report; this many is a
		// broken path.
		e.t.Fatalf("%s on %s: %d of %d connections failed, the first: %s; the stand-in's latest failure: %s",
			req.Op, p.name, r.Failures, r.Conns+r.Failures, r.FirstError, after.LastError)
	}
	if r.Failures > 0 || errs > 0 {
		f := e.failures[p.name]
		f.conns += r.Failures
		f.relay += errs
		if f.first == "" {
			f.first = fmt.Sprintf("client: %s; stand-in: %s", r.FirstError, strings.TrimSpace(after.LastError))
		}
		e.failures[p.name] = f
		slog.Warn("connections failed", "path", p.name, "op", req.Op, "failures", r.Failures, "standin_errors", errs, "first", r.FirstError)
	}
	if p.name == pathEBPF {
		if got := e.dpStats(p.client).OutboundRedirects - dpBefore.OutboundRedirects; got < uint64(r.Conns) {
			e.t.Fatalf("%s on ebpf: %d connections, but the dataplane redirected %d", req.Op, r.Conns, got)
		}
	}
	return r
}
