// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"time"
)

const bpfStatsSysctl = "/proc/sys/kernel/bpf_stats_enabled"

// profile runs one extra sequential connection-rate run on the eBPF path
// with kernel.bpf_stats_enabled=1 and notes what each of the dataplane's
// programs costs per run and per connection, to show how much of the path
// is BPF and how much is the rest (the stand-in's relays). The sysctl is
// put back as it was.
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
	defer func() { _ = os.WriteFile(bpfStatsSysctl, old, 0o644) }()

	p := e.paths[pathEBPF]
	var before, after []progStat
	if err := call(e.agent, agentRequest{Op: "progs", Config: e.dpCfg}, &before); err != nil {
		e.t.Fatalf("program stats: %v", err)
	}
	r := e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: e.s.duration})
	if err := call(e.agent, agentRequest{Op: "progs", Config: e.dpCfg}, &after); err != nil {
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
	perConn := time.Duration(0)
	if r.Conns > 0 {
		perConn = total / time.Duration(r.Conns)
	}
	res.Notes["bpf program stats (one ebpf conn_rate_seq run)"] = fmt.Sprintf("%d connections at %s conn/s; all programs %.1f us per connection, stand-in %.0f us CPU per connection; %s",
		r.Conns, num(rate(r)), us(perConn), float64(r.ztCPU.Microseconds())/float64(max(r.Conns, 1)), strings.Join(parts, "; "))
}

// pprofTop summarizes a CPU profile of this test binary (the helpers are
// the same executable) with `go tool pprof`: the heaviest functions by
// cumulative time, as "share name" pairs. A profile it cannot read gives
// the reason instead: a benchmark fails only on errors of the thing measured.
func pprofTop(profile string, n int, match *regexp.Regexp) string {
	self, err := os.Executable()
	if err != nil {
		return "no profile: " + err.Error()
	}
	out, err := exec.Command("go", "tool", "pprof", "-top", "-cum", "-nodecount=200", self, profile).Output()
	if err != nil {
		return "no profile: " + err.Error()
	}
	var parts []string
	for l := range strings.Lines(string(out)) {
		f := strings.Fields(l)
		// flat flat% sum% cum cum% name...
		if len(f) < 6 || !strings.HasSuffix(f[4], "%") || !match.MatchString(f[5]) {
			continue
		}
		parts = append(parts, f[4]+" "+f[5])
		if len(parts) == n {
			break
		}
	}
	if len(parts) == 0 {
		return "no samples"
	}
	return strings.Join(parts, "; ")
}
