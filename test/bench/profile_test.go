// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
)

const bpfStatsSysctl = "/proc/sys/kernel/bpf_stats_enabled"

// profile runs extra sequential connection-rate runs on the eBPF paths
// with kernel.bpf_stats_enabled=1 and notes what each of the dataplane's
// programs costs per run and per connection, to show how much of the path
// is BPF and how much is the rest: through the stand-in, and through the
// lean proxy with tracing off and on (bpf_us_per_conn). Then it profiles
// the lean proxy on both backends (perf), which shows what bounds the lean
// figures. The sysctl is put back as it was.
func (e *env) profile(res *Results) {
	old, err := os.ReadFile(bpfStatsSysctl)
	if err != nil {
		res.Notes["bpf program stats"] = "not measured: " + err.Error()
		return
	}
	if err := os.WriteFile(bpfStatsSysctl, []byte("1"), 0o644); err != nil {
		res.Notes["bpf program stats"] = "not measured: " + err.Error()
		return
	}
	p := e.paths[pathEBPF]
	r, total, parts := e.bpfStats(func() (int64, float64, time.Duration) {
		r := e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: e.s.duration})
		return r.Conns, rate(r), r.ztCPU
	})
	res.Notes["bpf program stats (one ebpf conn_rate_seq run)"] = fmt.Sprintf("%d connections at %s conn/s; all programs %.1f us per connection, stand-in %.0f us CPU per connection; %s",
		r.conns, benchdoc.Num(r.rate), us(total), float64(r.other.Microseconds())/float64(max(r.conns, 1)), parts)
	perConn := map[string][]float64{}
	for _, v := range e.leanVariants(res) {
		if v.name != pathEBPF && v.name != variantTrace {
			continue
		}
		// Three runs each, alternating, for a median.
		for range 3 {
			r, total, parts := e.bpfStats(func() (int64, float64, time.Duration) {
				r := e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: e.s.duration})
				return r.Conns, rate(r.run()), 0
			})
			perConn[v.name] = append(perConn[v.name], us(total))
			res.Notes["bpf program stats (ebpf-lean conn_rate_seq runs), "+v.name] = fmt.Sprintf("%d connections at %s conn/s; all programs %.2f us per connection; %s",
				r.conns, benchdoc.Num(r.rate), us(total), parts)
		}
	}
	if err := os.WriteFile(bpfStatsSysctl, old, 0o644); err != nil {
		e.t.Fatalf("restore %s: %v", bpfStatsSysctl, err)
	}
	res.Figures = append(res.Figures, newFigure("bpf_us_per_conn", "us/conn", "lower", "ebpf+trace: the same as ebpf without tracers", perConn).WithNote(
		"run time of all the dataplane's programs per connection (kernel.bpf_stats_enabled, three conn_rate_seq runs each) on the ebpf-lean "+
			"pair; ebpf+trace: the same while someone traces (every decision also written to the ring buffer); with nobody tracing each "+
			"decision costs one load of ae_tracing and a branch"))

	// The lean proxy, profiled on each backend.
	for _, v := range e.leanVariants(res) {
		if v.name != pathIptables && v.name != pathEBPF && v.name != variantProxy {
			continue
		}
		prof := startProfiler(e.leanpx.PID(), e.t.TempDir(), true)
		e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: e.s.duration})
		_, cpu := prof.finish(leanFrames)
		res.Notes["lean proxy CPU profile (perf, one conn_rate_seq run), "+v.name] = cpu
	}
	e.redirectProfile(res)
}

// redirectProfile shows where redirect_cpu_us goes: the whole machine
// sampled (perf -a) during conn_rate_seq runs of direct+proxy and of each
// meshed backend through the same lean proxy, alternating, three rounds;
// each function's own time per connection is set against direct+proxy's
// of the same round. What both share (the load generator, the relays, the
// three TCP connections) cancels; what is left is the redirection, by
// function and by kind (BPF, netfilter, locks, routing). Unlike
// redirect_cpu_us (the pods' and the proxy's cgroups), perf -a also sees
// softirq work that lands on an idle CPU.
func (e *env) redirectProfile(res *Results) {
	const hz, rounds = 1999, 3
	bases := []string{variantProxy, variantTransparent}
	// per base and round: the variant's total minus the base's
	deltas := map[string]map[string][]float64{variantProxy: {}, variantTransparent: {}}
	sums := map[string]map[string]float64{} // over the rounds: us per connection by function
	// per base, variant and round: the difference by kind
	byKind := map[string]map[string]map[string][]float64{variantProxy: {}, variantTransparent: {}}
	for range rounds {
		round := map[string]map[string]float64{}
		for _, v := range e.leanVariants(res) {
			if v.name != variantProxy && v.name != variantTransparent && v.name != pathIptables && v.name != pathEBPF {
				continue
			}
			prof := startPerf(e.t.TempDir(), true, hz, "-a")
			r := e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: e.s.duration})
			prof.stop()
			if prof.perf == nil {
				res.Notes["redirection CPU by function"] = prof.err
				return
			}
			samples, err := perfSamples(prof.data)
			os.Remove(prof.data)
			if err != nil {
				res.Notes["redirection CPU by function"] = "no CPU profile: " + err.Error()
				return
			}
			m := map[string]float64{}
			for sym, n := range samples {
				m[sym] = float64(n) / hz * 1e6 / float64(max(r.Conns, 1))
			}
			round[v.name] = m
			if sums[v.name] == nil {
				sums[v.name] = map[string]float64{}
			}
			for sym, us := range m {
				sums[v.name][sym] += us / rounds
			}
		}
		for _, b := range bases {
			base := round[b]
			names := []string{pathEBPF, pathIptables}
			if b == variantProxy {
				names = append(names, variantTransparent) // the contract's socket work alone
			}
			for _, name := range names {
				if round[name] == nil || base == nil {
					continue
				}
				got, want := kinds(round[name]), kinds(base)
				var total float64
				for k := range got {
					total += got[k] - want[k]
				}
				for k := range want {
					if _, ok := got[k]; !ok {
						total -= want[k]
					}
				}
				deltas[b][name] = append(deltas[b][name], total)
				if byKind[b][name] == nil {
					byKind[b][name] = map[string][]float64{}
				}
				for _, k := range profileKinds {
					byKind[b][name][k.name] = append(byKind[b][name][k.name], got[k.name]-want[k.name])
				}
			}
		}
	}
	const how = "the whole machine's CPU (perf -a, cpu-clock at 1999 Hz, idle left out) per connection of a conn_rate_seq run through the lean proxy minus "
	res.Figures = append(res.Figures,
		newFigure("redirect_profile_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", deltas[variantProxy]).WithNote(
			how+"direct+proxy's in the same round, three rounds: the redirection and ztunnel's socket contract, softirq on idle CPUs included; "+
				"direct+transparent: the contract's socket work alone"),
		newFigure("redirect_own_profile_us", "us CPU/conn", "lower", "ebpf <= 0.3x iptables", deltas[variantTransparent]).WithNote(
			how+"direct+transparent's in the same round, three rounds: the redirection alone, softirq on idle CPUs included"))
	for _, b := range bases {
		for _, name := range []string{pathEBPF, pathIptables, variantTransparent} {
			if sums[name] == nil || sums[b] == nil || byKind[b][name] == nil {
				continue
			}
			var parts []string
			for _, k := range profileKinds {
				parts = append(parts, fmt.Sprintf("%s %+.1f", k.name, summarize(byKind[b][name][k.name]).Median))
			}
			res.Notes["redirection CPU by kind (perf -a, us per connection minus "+b+"'s, median of three rounds), "+name] = strings.Join(parts, "; ")
			res.Notes["redirection CPU by function (perf -a, own time in us per connection minus "+b+"'s, mean of three rounds), "+name] =
				symbolDeltas(sums[name], sums[b], 14)
		}
	}
}

// profileKinds sort the kernel's functions by what they do; the last,
// with no pattern, takes the rest.
var profileKinds = []struct {
	name string
	re   *regexp.Regexp
}{
	// unit_alloc and unit_free are BPF's memory allocator's (hash map
	// elements), the *_elem_raw the hash maps' bucket walks.
	{"bpf", regexp.MustCompile(`^(bpf_|__bpf|___bpf|htab_|__htab|sock_hash|sock_map|__cgroup_bpf|cgroup_bpf|bpf_prog_|bpf_sk|sk_storage|bpf_local|unit_alloc$|unit_free$|lookup_nulls_elem_raw$|lookup_elem_raw$)`)},
	{"netfilter", regexp.MustCompile(`^(nf_|__nf|nft_|__nft|ipt_|ip6t_|xt_|ipv4_conntrack|ipv6_conntrack|hash_conntrack|iptable_|ip6table_|nf_nat|ipv4_confirm|ipv6_confirm)`)},
	{"locks", regexp.MustCompile(`(spin_lock|spin_unlock|queued_spin|_raw_read_lock|_raw_write_lock)`)},
	{"routing", regexp.MustCompile(`^(fib_|fib6_|__fib|ip_route|ip6_route|ip6_pol_route|rt_|rt6_|ip_rt|__ip_route|ip_mkroute|__mkroute|dst_|ipv4_dst|ip6_dst)`)},
	{"rest", nil},
}

// kinds sums us per connection by profileKinds.
func kinds(m map[string]float64) map[string]float64 {
	out := map[string]float64{}
	for sym, us := range m {
		for _, k := range profileKinds {
			if k.re == nil || k.re.MatchString(sym) {
				out[k.name] += us
				break
			}
		}
	}
	return out
}

// perfSamples counts a perf.data file's samples by function (own time),
// idle CPUs left out.
func perfSamples(data string) (map[string]int64, error) {
	out, err := exec.Command("perf", "report", "-i", data, "--stdio", "--no-header", "--no-children", "-n",
		"--sort", "comm,symbol", "-g", "none").Output()
	if err != nil {
		return nil, fmt.Errorf("perf report: %w", err)
	}
	return parseSamples(string(out)), nil
}

// parseSamples reads perf report's "share samples comm [k] symbol ..."
// lines (the columns after the symbol left aside); the idle task's
// samples (comm swapper) are left out.
func parseSamples(out string) map[string]int64 {
	m := map[string]int64{}
	for l := range strings.Lines(out) {
		f := strings.Fields(l)
		if len(f) < 5 || !strings.HasSuffix(f[0], "%") {
			continue
		}
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			continue
		}
		// The comm may hold spaces: the symbol follows the [k] or [.] tag.
		i := slices.IndexFunc(f[2:], func(s string) bool { return s == "[k]" || s == "[.]" })
		if i < 0 || 2+i+1 >= len(f) {
			continue
		}
		if strings.Join(f[2:2+i], " ") == "swapper" {
			continue
		}
		m[f[2+i+1]] += n
	}
	return m
}

// symbolDeltas lists the total difference and the n functions whose own
// time per connection grew most from base to got.
func symbolDeltas(got, base map[string]float64, n int) string {
	type delta struct {
		sym string
		d   float64
	}
	var ds []delta
	var total, all float64
	for sym, v := range got {
		all += v
		total += v - base[sym]
		ds = append(ds, delta{sym, v - base[sym]})
	}
	for sym, v := range base {
		if _, ok := got[sym]; !ok {
			total -= v
			ds = append(ds, delta{sym, -v})
		}
	}
	slices.SortFunc(ds, func(a, b delta) int {
		if a.d != b.d {
			if a.d > b.d {
				return -1
			}
			return 1
		}
		return strings.Compare(a.sym, b.sym)
	})
	parts := []string{fmt.Sprintf("total %+.1f of %.1f", total, all)}
	for _, d := range ds[:min(n, len(ds))] {
		parts = append(parts, fmt.Sprintf("%s %+.1f", d.sym, d.d))
	}
	return strings.Join(parts, "; ")
}

// leanFrames are the functions worth naming in the lean proxy's profile:
// the system calls it makes and the kernel's TCP, netfilter and BPF work
// under them.
var leanFrames = regexp.MustCompile(`^(__x64_sys_|__sys_|tcp_|inet_|nf_|ipt_|bpf_|__cgroup_bpf|ip_|__ip|ip6_|ep_|do_epoll|sock_|__sock|__inet|__tcp|__dev_queue_xmit|veth_|__netif|net_rx|process_backlog|github.com/ambient-ebpf)`)

// bpfRun is what one profiled run did.
type bpfRun struct {
	conns int64
	rate  float64
	other time.Duration // the stand-in's CPU, where measured
}

// bpfStats runs fn (which reports connections, rate and another CPU time)
// and returns the dataplane's programs' run time per connection and by
// program.
func (e *env) bpfStats(fn func() (int64, float64, time.Duration)) (bpfRun, time.Duration, string) {
	before, err := progStats(e.node.BPFFSDir)
	if err != nil {
		e.t.Fatalf("program stats: %v", err)
	}
	var r bpfRun
	r.conns, r.rate, r.other = fn()
	after, err := progStats(e.node.BPFFSDir)
	if err != nil {
		e.t.Fatalf("program stats: %v", err)
	}
	prev := map[string]progStat{}
	for _, s := range before {
		prev[s.Name] = s
	}
	var parts []string
	var total time.Duration
	for _, s := range after {
		runs, rt := s.Runs-prev[s.Name].Runs, s.Runtime-prev[s.Name].Runtime
		if runs == 0 {
			continue
		}
		total += rt
		parts = append(parts, fmt.Sprintf("%s %d runs, %d ns/run", s.Name, runs, rt.Nanoseconds()/int64(runs)))
	}
	if r.conns > 0 {
		total /= time.Duration(r.conns)
	}
	return r, total, strings.Join(parts, "; ")
}

// profiler watches work while it runs: with a process to follow, its
// threads' kernel stacks (stackSampler: where it waits); when perf is on
// PATH, CPU time by function, kernel and user space (perf record on the
// software clock; the binaries keep their symbols and Go's frame pointers
// give the call chains), of the process or of the whole machine.
type profiler struct {
	stacks *stackSampler
	perf   *exec.Cmd
	data   string
	err    string // why there is no CPU profile
}

// startProfiler follows process pid. With settle it returns once perf
// samples (it takes a moment to start), else at once.
func startProfiler(pid int, dir string, settle bool) *profiler {
	p := startPerf(dir, settle, 499, "-p", strconv.Itoa(pid))
	p.stacks = startStackSampler(pid)
	return p
}

// startMachineProfiler samples every CPU, for work spread over short-lived
// processes (CNI plugins and what they run), four times as often as a
// process's profiler: a batch of plugin execs is a fraction of a second
// of CPU.
func startMachineProfiler(dir string) *profiler { return startPerf(dir, true, 1999, "-a") }

// perfStartup is how long perf record takes to sample after its start.
const perfStartup = 500 * time.Millisecond

func startPerf(dir string, settle bool, hz int, target ...string) *profiler {
	p := &profiler{data: filepath.Join(dir, fmt.Sprintf("perf-%d.data", time.Now().UnixNano()))}
	path, err := exec.LookPath("perf")
	if err != nil {
		p.err = "no CPU profile: perf is not on PATH"
		return p
	}
	p.perf = exec.Command(path, append([]string{"record", "-q", "-e", "cpu-clock", "-F", strconv.Itoa(hz), "-g", "-o", p.data}, target...)...)
	if err := p.perf.Start(); err != nil {
		p.err, p.perf = "no CPU profile: "+err.Error(), nil
	} else if settle {
		time.Sleep(perfStartup)
	}
	return p
}

// stop ends the sampling; waits are the top kernel wait stacks.
func (p *profiler) stop() (waits string) {
	if p.stacks != nil {
		waits = p.stacks.finish(6)
	}
	if p.perf == nil {
		return waits
	}
	_ = p.perf.Process.Signal(os.Interrupt)
	// perf record writes its data and then re-raises the SIGINT.
	var exit *exec.ExitError
	if err := p.perf.Wait(); err != nil && !(errors.As(err, &exit) && exit.Sys().(syscall.WaitStatus).Signal() == syscall.SIGINT) {
		p.err, p.perf = "no CPU profile: perf record: "+err.Error(), nil
	}
	return waits
}

// finish stops and summarizes: the top kernel wait stacks, and the CPU
// profile's heaviest functions, cumulative (those matching match) and by
// their own time.
func (p *profiler) finish(match *regexp.Regexp) (waits, cpu string) {
	waits = p.stop()
	if p.perf == nil {
		return waits, p.err
	}
	defer os.Remove(p.data)
	cum, err := perfTop(p.data, "symbol", true, 14, match, 100)
	if err != nil {
		return waits, "no CPU profile: " + err.Error()
	}
	self, err := perfTop(p.data, "symbol", false, 6, nil, 100)
	if err != nil {
		return waits, "no CPU profile: " + err.Error()
	}
	return waits, "cumulative: " + cum + "; own time: " + self
}

// byProcess stops and lists the CPU samples' shares of the command names
// ours (comm is cut at 15 characters), then what the kernel's threads,
// idle CPUs and everything else on the machine took; with focus, also the
// heaviest functions of that command matching match, cumulative, as
// shares of that command's samples.
func (p *profiler) byProcess(focus string, match *regexp.Regexp, ours ...string) (shares, focused string) {
	p.stop()
	if p.perf == nil {
		return p.err, p.err
	}
	defer os.Remove(p.data)
	out, err := exec.Command("perf", "report", "-i", p.data, "--stdio", "--no-header", "--no-children", "--sort", "comm", "-g", "none").Output()
	if err != nil {
		return "no CPU profile: perf report: " + err.Error(), ""
	}
	var parts []string
	var kernel, idle, other, focusShare float64
	for l := range strings.Lines(string(out)) {
		f := strings.Fields(l)
		if len(f) < 2 || !strings.HasSuffix(f[0], "%") {
			continue
		}
		share, err := strconv.ParseFloat(strings.TrimSuffix(f[0], "%"), 64)
		if err != nil {
			continue
		}
		comm := strings.Join(f[1:], " ")
		if comm == focus {
			focusShare = share
		}
		switch {
		case slices.Contains(ours, comm):
			parts = append(parts, fmt.Sprintf("%.1f%% %s", share, comm))
		case comm == "swapper":
			idle += share
		case kernelThread.MatchString(comm):
			kernel += share
		default:
			other += share
		}
	}
	shares = fmt.Sprintf("%s; kernel threads %.1f%%; idle %.1f%%; other processes on the machine %.1f%%", strings.Join(parts, "; "), kernel, idle, other)
	if focus == "" {
		return shares, ""
	}
	if focusShare == 0 {
		return shares, "no samples"
	}
	// perf's shares are of all samples: scaled to the command's own.
	focused, err = perfTop(p.data, "symbol", true, 16, match, focusShare, "--comms", focus)
	if err != nil {
		focused = "no CPU profile: " + err.Error()
	}
	return shares, focused
}

var kernelThread = regexp.MustCompile(`^(kworker|ksoftirqd|rcu_|migration|kthreadd|cpuhp|idle_inject|irq/)`)

// perfTop lists the n heaviest entries of a perf.data file sorted by key
// (symbol or comm) as "share name" pairs: by cumulative share (children),
// or by own time, as percentages of of percent of all samples (100: of
// all); filter is more of perf report's arguments.
func perfTop(data, key string, children bool, n int, match *regexp.Regexp, of float64, filter ...string) (string, error) {
	mode := "--no-children"
	if children {
		mode = "--children"
	}
	// Entries under 0.5% of what is listed are left out.
	limit := strconv.FormatFloat(0.5*of/100, 'f', 3, 64)
	args := append([]string{"report", "-i", data, "--stdio", "--no-header", mode, "--sort", key, "-g", "none", "--percent-limit", limit}, filter...)
	out, err := exec.Command("perf", args...).Output()
	if err != nil {
		return "", fmt.Errorf("perf report: %w", err)
	}
	var parts []string
	for l := range strings.Lines(string(out)) {
		f := strings.Fields(l)
		// children% self% [.] symbol; self% [.] symbol; self% comm
		i := 1
		if children {
			i = 2
		}
		if key == "symbol" {
			if len(f) <= i+1 || !strings.HasPrefix(f[i], "[") {
				continue
			}
			i++
		}
		if len(f) <= i || !strings.HasSuffix(f[0], "%") || strings.HasPrefix(f[0], "#") {
			continue
		}
		if match != nil && !match.MatchString(f[i]) {
			continue
		}
		share, err := strconv.ParseFloat(strings.TrimSuffix(f[0], "%"), 64)
		if err != nil {
			continue
		}
		parts = append(parts, fmt.Sprintf("%.2f%% %s", share*100/of, f[i]))
		if len(parts) == n {
			break
		}
	}
	if len(parts) == 0 {
		return "no samples", nil
	}
	return strings.Join(parts, "; "), nil
}

func TestParseSamples(t *testing.T) {
	out := `# Overhead       Samples  Command          Symbol                                         IPC   [IPC Coverage]
# ........  ............  ...............  .............................................  ....................
#
     9.33%           373  gzip             [.] 0x000000000000cc5c                         -      -
     6.65%           266  gzip             [k] copy_folio_from_iter_atomic                -      -
     5.00%           200  swapper          [k] pv_native_safe_halt                        -      -
     1.00%            40  kworker/0:1 H    [k] copy_folio_from_iter_atomic                -      -
     0.50%            20  lean proxy       [k] tcp_v4_rcv
`
	got := parseSamples(out)
	want := map[string]int64{"0x000000000000cc5c": 373, "copy_folio_from_iter_atomic": 306, "tcp_v4_rcv": 20}
	if !maps.Equal(got, want) {
		t.Errorf("parseSamples = %v, want %v", got, want)
	}
	if d := symbolDeltas(map[string]float64{"a": 3, "b": 1}, map[string]float64{"a": 1, "c": 0.5}, 2); d != "total +2.5 of 4.0; a +2.0; b +1.0" {
		t.Errorf("symbolDeltas = %q", d)
	}
	k := kinds(map[string]float64{"bpf_prog_10b9f1ec5d33c153_ae_pod_lo_ingress": 1, "htab_map_update_elem": 2, "nft_do_chain": 4,
		"__pv_queued_spin_lock_slowpath": 8, "fib_table_lookup": 16, "tcp_v4_rcv": 32, "unit_free": 64, "lookup_nulls_elem_raw": 128})
	if want := map[string]float64{"bpf": 195, "netfilter": 4, "locks": 8, "routing": 16, "rest": 32}; !maps.Equal(k, want) {
		t.Errorf("kinds = %v, want %v", k, want)
	}
}
