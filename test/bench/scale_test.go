// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bench

import (
	"fmt"
	"log/slog"
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
	rateAt := func() []float64 {
		var rates []float64
		for range e.s.reps {
			rates = append(rates, rate(e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: e.s.duration})))
		}
		return rates
	}
	at1 := rateAt()

	r, err := e.enroll(pods)
	if err != nil {
		e.t.Fatalf("enroll %d pods: %v", n, err)
	}
	var mem memResult
	if err := call(e.agent, agentRequest{Op: "mem", Config: e.dpCfg}, &mem); err != nil {
		e.t.Fatalf("agent memory: %v", err)
	}
	slog.Info("scale enrolled", "pods", n, "total", r.Total, "rss_mib", mib(mem.RSSBytes))
	atN := rateAt()

	ratios := make([]float64, len(at1))
	for i := range at1 {
		ratios[i] = atN[i] / at1[i]
	}
	one := func(v float64) map[string][]float64 { return map[string][]float64{pathEBPF: {v}} }
	res.Figures = append(res.Figures,
		newFigure("scale_enroll_1000_s", "s", "lower", "<= 5 s", one(r.Total.Seconds())),
		newFigure("scale_agent_rss_mib", "MiB", "lower", "<= 64 MiB", one(mib(mem.RSSBytes))),
		newFigure("scale_bpf_map_mib", "MiB", "lower", "", one(mib(mem.MapBytes))),
		newFigure("scale_rate_1000_vs_1", "ratio", "higher", ">= 0.95", map[string][]float64{pathEBPF: ratios}),
	)
	lat := slices.Clone(r.Latencies)
	slices.Sort(lat)
	res.Notes["scale: per-pod Enroll latency while enrolling"] = fmt.Sprintf("p50 %.2f ms, p99 %.2f ms, max %.2f ms",
		ms(percentile(lat, 50)), ms(percentile(lat, 99)), ms(lat[len(lat)-1]))
	res.Notes["scale: agent memory"] = fmt.Sprintf("RSS %.1f MiB before, %.1f MiB at %d pods, peak %.1f MiB; %d pinned maps charge %.1f MiB (preallocated, the same at 1 pod: %.1f MiB)",
		mib(memBefore.RSSBytes), mib(mem.RSSBytes), n, mib(mem.HWMBytes), mem.MapsCount, mib(mem.MapBytes), mib(memBefore.MapBytes))
	res.Notes["scale: conn_rate_seq on the ebpf path"] = fmt.Sprintf("%s conn/s at 1 enrolled pair, %s conn/s at %d more pods",
		num(summarize(at1).Median), num(summarize(atN).Median), n)

	t0 = time.Now()
	if err := e.remove(pods); err != nil {
		e.t.Fatalf("remove %d pods: %v", n, err)
	}
	res.Notes["scale: removing the pods"] = time.Since(t0).Round(time.Millisecond).String()
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }
