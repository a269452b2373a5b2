// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The bounded echo of throughput_echo, and its server's port.
const (
	sockmapBulk     = 64 << 20
	sockmapEchoPort = 7002
)

// The sockmap acceleration's modes, as the figures name them.
var sockmapModes = []accel.Mode{accel.Off, accel.ToZtunnel, accel.Both}

// SockmapResults are the figures of TestBenchSockmap: the eBPF path
// through the stand-in, each mode of --sockmap-accel in turn, on one pair
// of pods. Written to BENCH_SOCKMAP_RESULTS (make bench-sockmap).
type SockmapResults struct {
	Commit  string            `json:"commit"`
	Machine Machine           `json:"machine"`
	Config  map[string]string `json:"config"`
	Figures []SockmapFigure   `json:"figures"`
}

// SockmapFigure is one figure per mode, with each accelerated mode's ratio
// to off.
type SockmapFigure struct {
	Name   string              `json:"name"`
	Unit   string              `json:"unit"`
	Better string              `json:"better"`
	Modes  map[string]*Summary `json:"modes"`
	// RatioToOff is each accelerated mode's median over off's.
	RatioToOff map[string]float64 `json:"ratio_to_off"`
	Target     string             `json:"target,omitempty"`
}

// TestBenchSockmap measures what --sockmap-accel does to the meshed eBPF
// path through the ztunnel stand-in: connection rate, round-trip latency
// and throughput, the modes alternating within every repetition on the
// same client and server pods (the data path restarted in each mode, as an
// agent restarted with the flag). The hop it accelerates is the pods' own
// app <-> ztunnel one, on both pods. A run fails on errors and on a
// connection that did not take the path (not through the stand-in, or not
// accelerated as its mode says), never on a number.
func TestBenchSockmap(t *testing.T) {
	if os.Getenv(EnableEnv) != "1" {
		t.Skipf("benchmarks run with %s=1 (make bench-sockmap)", EnableEnv)
	}
	s := loadSettings()
	out := os.Getenv("BENCH_SOCKMAP_RESULTS")
	if out == "" {
		out = "../../bench/sockmap.json"
	}
	n := simnode.New(t)
	client, server := n.AddPod("sm-c"), n.AddPod("sm-s")
	for _, pod := range []*simnode.Pod{client, server} {
		n.Sysctl(pod.NS, "net/ipv4/tcp_tw_reuse", "1")
	}
	// As TestBench's pods: no TIME_WAIT in the server pod, disjoint
	// ephemeral ports (docs/BENCHMARKS.md).
	n.Sysctl(server.NS, "net/ipv4/tcp_max_tw_buckets", "0")
	n.Sysctl(client.NS, "net/ipv4/ip_local_port_range", "32768 46999")
	n.Sysctl(server.NS, "net/ipv4/ip_local_port_range", "47000 60999")
	cg := filepath.Join(n.CgroupRoot, "ztunnel")
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	var dp *dataplane.Dataplane
	start := func(mode accel.Mode) {
		if dp != nil {
			if err := dp.Close(); err != nil {
				t.Fatal(err)
			}
		}
		c := cfg
		c.SockmapAccel = mode
		var err error
		if dp, err = dataplane.New(c); err != nil {
			t.Fatalf("dataplane with --sockmap-accel=%s: %v", mode, err)
		}
		if st := dp.AccelStatus(); st.Active != mode.On() {
			t.Fatalf("--sockmap-accel=%s: %+v", mode, st)
		}
	}
	start(accel.Off)
	t.Cleanup(func() { _ = dp.Uninstall() })
	for _, pod := range []*simnode.Pod{client, server} {
		if err := dp.Enroll(t.Context(), dpPod(pod)); err != nil {
			t.Fatal(err)
		}
	}
	// As on a node, ztunnel opens a pod's listeners after the data path
	// is loaded (sockops files them then).
	zt := simnode.StartHelper(t, roleZtunnel, n.NodeNS, cg)
	for _, pod := range []*simnode.Pod{client, server} {
		if err := call(zt, ztunnelRequest{Op: "add", UID: pod.UID, Netns: pod.NetnsPath()}, nil); err != nil {
			t.Fatalf("ztunnel add %s: %v", pod.Name, err)
		}
	}
	srv := simnode.StartHelper(t, roleServer, server.NS, server.Cgroup)
	if err := call(srv, serverRequest{Op: "listen"}, nil); err != nil {
		t.Fatal(err)
	}
	gen := simnode.StartHelper(t, roleClient, client.NS, client.Cgroup)
	echo := fmt.Sprintf("%s:%d", server.V4, echoPort)
	// Throughput is a bounded echo (simnode's bulk-tcp against a
	// read/write echo server), not the load generator's send-for-a-while:
	// with the acceleration nothing holds a fast sender back (see
	// docs/BENCHMARKS.md), so an unbounded send queues until the node's
	// TCP memory runs out and the app's write fails with ENOMEM.
	bulkApp := &simnode.App{Proc: simnode.StartHelper(t, simnode.RoleApp, client.NS, client.Cgroup)}
	echoApp := &simnode.App{Proc: simnode.StartHelper(t, simnode.RoleApp, server.NS, server.Cgroup)}
	if _, err := echoApp.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), sockmapEchoPort), ReadWrite: true}); err != nil {
		t.Fatal(err)
	}
	bulkDst := netip.AddrPortFrom(server.V4, sockmapEchoPort)

	// proven runs fn and checks that its conns connections went through the
	// stand-in, both hops, and through the sockmap as mode says; it returns
	// the bytes the sockmap carried.
	proven := func(mode accel.Mode, what string, fn func() int64) uint64 {
		t.Helper()
		var z0, z1 ztunnelCounts
		if err := call(zt, ztunnelRequest{Op: "counts"}, &z0); err != nil {
			t.Fatal(err)
		}
		a0, err := accel.Read(n.BPFFSDir)
		if err != nil {
			t.Fatal(err)
		}
		conns := fn()
		if err := call(zt, ztunnelRequest{Op: "counts"}, &z1); err != nil {
			t.Fatal(err)
		}
		a1, err := accel.Read(n.BPFFSDir)
		if err != nil {
			t.Fatal(err)
		}
		if out, in := z1.Outbound-z0.Outbound, z1.Inbound-z0.Inbound; out < conns || in < conns {
			t.Fatalf("%s on --sockmap-accel=%s: %d connections, the stand-in saw %d outbound and %d inbound", what, mode, conns, out, in)
		}
		redirected := a1.Stats.RedirectBytes - a0.Stats.RedirectBytes
		if mode.On() != (redirected > 0) {
			t.Fatalf("%s on --sockmap-accel=%s: %d bytes went through the sockmap", what, mode, redirected)
		}
		return redirected
	}
	measure := func(mode accel.Mode, req loadRequest) loadResult {
		t.Helper()
		var r loadResult
		proven(mode, req.Op, func() int64 {
			if err := call(gen, req, &r); err != nil {
				t.Fatalf("%s on --sockmap-accel=%s: %v", req.Op, mode, err)
			}
			return r.Conns
		})
		if r.Failures > 0 {
			// A connection the acceleration broke is a defect, not noise.
			t.Fatalf("%s on --sockmap-accel=%s: %d of %d connections failed, the first: %s", req.Op, mode, r.Failures, r.Conns+r.Failures, r.FirstError)
		}
		return r
	}
	// echoed sends sockmapBulk bytes through both hops and back and
	// returns the rate each way, in Gbit/s.
	echoed := func(mode accel.Mode) float64 {
		t.Helper()
		var elapsed time.Duration
		redirected := proven(mode, "bulk echo", func() int64 {
			t0 := time.Now()
			resp, err := bulkApp.Do(simnode.AppRequest{Op: "bulk-tcp", Addr: bulkDst, Bytes: sockmapBulk})
			elapsed = time.Since(t0)
			if err != nil || resp.Echoed != sockmapBulk {
				t.Fatalf("bulk echo on --sockmap-accel=%s: %d of %d bytes came back: %v", mode, resp.Echoed, sockmapBulk, err)
			}
			return 1
		})
		// Each of the two pods' hops carries the bytes both ways.
		if want := map[accel.Mode]uint64{accel.Off: 0, accel.ToZtunnel: 2 * sockmapBulk, accel.Both: 4 * sockmapBulk}[mode]; redirected != want {
			t.Fatalf("bulk echo on --sockmap-accel=%s: the sockmap carried %d bytes, want %d", mode, redirected, want)
		}
		return float64(sockmapBulk) * 8 / elapsed.Seconds() / 1e9
	}

	begin := time.Now()
	seq, conc, p50, p99, tput := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	for rep := range s.reps {
		for _, mode := range sockmapModes {
			m := string(mode)
			start(mode)
			if rep == 0 {
				measure(mode, loadRequest{Op: "conn", Addr: echo, Duration: 200 * time.Millisecond}) // warm-up
			}
			r := measure(mode, loadRequest{Op: "conn", Addr: echo, Duration: s.duration})
			seq[m] = append(seq[m], rate(run{loadResult: r}))
			r = measure(mode, loadRequest{Op: "conn", Addr: echo, Duration: s.duration, Conc: s.conc})
			conc[m] = append(conc[m], rate(run{loadResult: r}))
			r = measure(mode, loadRequest{Op: "rr", Addr: echo, Count: s.rtts})
			p50[m] = append(p50[m], us(percentile(r.RTTs, 50)))
			p99[m] = append(p99[m], us(percentile(r.RTTs, 99)))
			tput[m] = append(tput[m], echoed(mode))
		}
		slog.Info("sockmap repetition done", "rep", rep+1, "of", s.reps, "conn_seq", last(seq), "rr_p99_us", last(p99), "gbit", last(tput))
	}
	res := &SockmapResults{Commit: gitCommit(), Machine: describeMachine(), Config: map[string]string{
		"repetitions":      strconv.Itoa(s.reps),
		"run duration":     s.duration.String(),
		"concurrent loops": strconv.Itoa(s.conc),
		"round trips":      strconv.Itoa(s.rtts),
		"traffic":          "IPv4, client pod to server pod on the same node, both enrolled on the eBPF path: app -> ztunnel (client pod, accelerated hop) -> ztunnel -> app (server pod, accelerated hop); the stand-in relays with read/write",
		"throughput_echo":  fmt.Sprintf("%d MiB sent in writes of up to 256 KiB and echoed back at once by a read/write server, timed to the last byte back (a bounded transfer: see docs/BENCHMARKS.md)", sockmapBulk>>20),
		"modes":            "off, ztunnel (the app's sends into ztunnel skip TCP), both (ztunnel's into the app too); the data path restarted in each mode within every repetition",
		"total time":       time.Since(begin).Round(time.Second).String(),
	}, Figures: []SockmapFigure{
		sockmapFigure("conn_rate_seq", "conn/s", "higher", "", seq),
		sockmapFigure("conn_rate_conc", "conn/s", "higher", "", conc),
		sockmapFigure("rr_latency_p50", "us", "lower", "", p50),
		sockmapFigure("rr_latency_p99", "us", "lower", "<= 0.7x off", p99),
		sockmapFigure("throughput_echo", "Gbit/s each way", "higher", "", tput),
	}}
	b, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, append(b, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("results in %s:\n%s", out, res.markdown())
}

func sockmapFigure(name, unit, better, target string, samples map[string][]float64) SockmapFigure {
	f := SockmapFigure{Name: name, Unit: unit, Better: better, Target: target, Modes: map[string]*Summary{}, RatioToOff: map[string]float64{}}
	for _, m := range sockmapModes {
		f.Modes[string(m)] = summarize(samples[string(m)])
	}
	off := f.Modes[string(accel.Off)]
	for _, m := range sockmapModes[1:] {
		if s := f.Modes[string(m)]; s != nil && off != nil && off.Median != 0 {
			f.RatioToOff[string(m)] = s.Median / off.Median
		}
	}
	return f
}

// markdown is the figures as a table: medians (min-max) and ratios to off.
func (r *SockmapResults) markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "| figure | off | ztunnel | both | ztunnel/off | both/off |\n|---|---|---|---|---|---|\n")
	for _, f := range r.Figures {
		fmt.Fprintf(&b, "| %s (%s) ", f.Name, f.Unit)
		for _, m := range sockmapModes {
			if s := f.Modes[string(m)]; s != nil {
				fmt.Fprintf(&b, "| %s (%s-%s) ", benchdoc.Num(s.Median), benchdoc.Num(s.Min), benchdoc.Num(s.Max))
			} else {
				b.WriteString("| - ")
			}
		}
		for _, m := range sockmapModes[1:] {
			fmt.Fprintf(&b, "| %.2fx ", f.RatioToOff[string(m)])
		}
		b.WriteString("|\n")
	}
	return b.String()
}
