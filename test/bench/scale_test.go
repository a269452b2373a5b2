// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"regexp"
	"slices"
	"time"
)

// scale enrolls scalePods lightweight pods into the dataplane, one after
// the other as CNI ADDs would arrive, and measures the time, the agent's
// memory, and the eBPF path's sequential connection rate before and
// after.
func (e *env) scale(res *Results) {
	n := e.s.scalePods
	p := e.paths[pathEBPF]
	t0 := time.Now()
	pods, err := e.light.add("s", n)
	if err != nil {
		e.t.Fatalf("make %d pods: %v", n, err)
	}
	res.Notes["scale: making the pods (netns + veth, not timed)"] = time.Since(t0).Round(time.Millisecond).String()

	var memBefore memResult
	if err := call(e.agent, agentRequest{Op: "mem", Config: e.dpCfg}, &memBefore); err != nil {
		e.t.Fatalf("agent memory: %v", err)
	}
	// The eBPF path's rate, alternated with the iptables path's: the
	// iptables path goes through the same stand-in and does not depend
	// on the dataplane's pod count, so ebpf/iptables cancels the drift
	// of a shared machine.
	ref := e.paths[pathIptables]
	rateAt := func() (ebpf, norm []float64) {
		for range e.s.reps {
			r := rate(e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: e.s.duration}))
			ri := rate(e.measure(ref, loadRequest{Op: "conn", Addr: ref.echo, Duration: e.s.duration}))
			ebpf, norm = append(ebpf, r), append(norm, r/ri)
		}
		return ebpf, norm
	}
	at1, norm1 := rateAt()

	profile := filepath.Join(e.t.TempDir(), "agent-enroll.pprof")
	if err := call(e.agent, agentRequest{Op: "pprof-start", Path: profile}, nil); err != nil {
		e.t.Fatalf("agent profile: %v", err)
	}
	sampler := startStackSampler(e.agent.PID())
	cpu0 := cpuTime(e.agent.PID())
	r, err := e.enroll(pods)
	agentCPU := cpuTime(e.agent.PID()) - cpu0
	res.Notes["scale: where the agent's threads wait in the kernel while enrolling"] = sampler.finish(6)
	if err := call(e.agent, agentRequest{Op: "pprof-stop"}, nil); err != nil {
		e.t.Fatalf("agent profile: %v", err)
	}
	res.Notes["scale: agent CPU profile while enrolling (cumulative share of the samples)"] = pprofTop(profile, 12, agentFrames)
	if err != nil {
		e.t.Fatalf("enroll %d pods: %v", n, err)
	}
	var mem memResult
	if err := call(e.agent, agentRequest{Op: "mem", Config: e.dpCfg}, &mem); err != nil {
		e.t.Fatalf("agent memory: %v", err)
	}
	slog.Info("scale enrolled", "pods", n, "total", r.Total, "rss_mib", mib(mem.RSSBytes))
	atN, normN := rateAt()

	// The figure: per repetition, the normalized rate at N over the one
	// at 1.
	ratios := make([]float64, len(norm1))
	for i := range norm1 {
		ratios[i] = normN[i] / norm1[i]
	}
	one := func(v float64) map[string][]float64 { return map[string][]float64{pathEBPF: {v}} }
	res.Figures = append(res.Figures,
		newFigure("scale_enroll_1000_s", "s", "lower", "<= 5 s", one(r.Total.Seconds())),
		newFigure("scale_agent_rss_mib", "MiB", "lower", "<= 64 MiB", one(mib(mem.RSSBytes))),
		newFigure("scale_bpf_map_mib", "MiB", "lower", "", one(mib(mem.MapBytes))),
		newFigure("scale_rate_1000_vs_1", "ratio", "higher", ">= 0.95", map[string][]float64{pathEBPF: ratios}),
	)
	res.Notes["scale: agent CPU while enrolling"] = fmt.Sprintf("%s CPU in %s wall time (%.1f ms CPU per pod)",
		agentCPU.Round(time.Millisecond), r.Total.Round(time.Millisecond), ms(agentCPU)/float64(n))
	lat := slices.Clone(r.Latencies)
	slices.Sort(lat)
	res.Notes["scale: per-pod Enroll latency while enrolling"] = fmt.Sprintf("p50 %.2f ms, p99 %.2f ms, max %.2f ms",
		ms(percentile(lat, 50)), ms(percentile(lat, 99)), ms(lat[len(lat)-1]))
	res.Notes["scale: agent memory"] = fmt.Sprintf("RSS %.1f MiB before, %.1f MiB at %d pods, peak %.1f MiB; %d pinned maps charge %.1f MiB (preallocated, the same at 1 pod: %.1f MiB)",
		mib(memBefore.RSSBytes), mib(mem.RSSBytes), n, mib(mem.HWMBytes), mem.MapsCount, mib(mem.MapBytes), mib(memBefore.MapBytes))
	res.Notes["scale: conn_rate_seq on the ebpf path"] = fmt.Sprintf("%s conn/s at 1 enrolled pair, %s conn/s at %d more pods; "+
		"raw ratio %.2fx; relative to the iptables path alternated with it, %.2f and %.2f (the figure uses these)",
		num(summarize(at1).Median), num(summarize(atN).Median), n, summarize(atN).Median/summarize(at1).Median,
		summarize(norm1).Median, summarize(normN).Median)

	t0 = time.Now()
	if err := e.remove(pods); err != nil {
		e.t.Fatalf("remove %d pods: %v", n, err)
	}
	res.Notes["scale: removing the pods"] = time.Since(t0).Round(time.Millisecond).String()
}

// agentFrames are the functions worth naming in the agent's profile: the
// dataplane's and the libraries it calls, not the runtime's plumbing.
var agentFrames = regexp.MustCompile(`dataplane\.|ebpf\.|link\.|netlink\.|^net\.|syscall\.|unix\.|runtime\.(gcBgMarkWorker|mallocgc)$`)

func mib(b int64) float64 { return float64(b) / (1 << 20) }
