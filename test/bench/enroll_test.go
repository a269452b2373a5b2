// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"slices"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
)

// enrollment times enrolling fresh pods: dataplane.Enroll in the agent
// versus applying istio-cni's rules in the pod netns. Repetitions
// alternate the two; every enrollment gets a pod never enrolled before.
func (e *env) enrollment(res *Results) {
	p50, p99 := map[string][]float64{}, map[string][]float64{}
	for rep := range e.s.reps {
		for _, name := range []string{pathIptables, pathEBPF} {
			pods, err := e.light.add(fmt.Sprintf("e%d%s", rep, name[:1]), e.s.enrollPods)
			if err != nil {
				e.t.Fatalf("make pods: %v", err)
			}
			var lat []time.Duration
			switch name {
			case pathEBPF:
				r, err := e.enroll(pods)
				if err != nil {
					e.t.Fatalf("enroll: %v", err)
				}
				lat = r.Latencies
				if err := e.remove(pods); err != nil {
					e.t.Fatalf("remove: %v", err)
				}
			case pathIptables:
				for _, p := range pods {
					t0 := time.Now()
					e.ipt.Enroll(e.t, p, reference.Opts{})
					lat = append(lat, time.Since(t0))
				}
			}
			slices.Sort(lat)
			p50[name] = append(p50[name], ms(percentile(lat, 50)))
			p99[name] = append(p99[name], ms(percentile(lat, 99)))
		}
	}
	res.Figures = append(res.Figures,
		newFigure("enroll_latency_p50", "ms", "lower", "", p50),
		newFigure("enroll_latency_p99", "ms", "lower", "ebpf <= 5 ms and <= 0.1x iptables", p99),
	)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
