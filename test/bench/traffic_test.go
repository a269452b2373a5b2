// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
)

// traffic measures connection rates, round-trip latency and throughput on
// the three paths, alternating them in every repetition.
func (e *env) traffic(res *Results) {
	s := e.s
	// Warm up every path (the first connections pay for conntrack,
	// neighbour and socket set-up).
	for _, name := range allPaths {
		p := e.paths[name]
		e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: 200 * time.Millisecond})
	}

	seq, conc := map[string][]float64{}, map[string][]float64{}
	p50, p90, p99 := map[string][]float64{}, map[string][]float64{}, map[string][]float64{}
	tput := map[string][]float64{}
	ztPerConn, cpuPerConn := map[string][]float64{}, map[string][]float64{}
	for rep := range s.reps {
		for _, name := range allPaths {
			p := e.paths[name]
			r := e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: s.duration})
			seq[name] = append(seq[name], rate(r))
			if r.Conns > 0 {
				cpuPerConn[name] = append(cpuPerConn[name], us(r.cpu)/float64(r.Conns))
			}
			if r.Conns > 0 && name != pathDirect {
				ztPerConn[name] = append(ztPerConn[name], float64(r.ztCPU.Microseconds())/float64(r.Conns))
			}
		}
		for _, name := range allPaths {
			p := e.paths[name]
			conc[name] = append(conc[name], rate(e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: s.duration, Conc: s.conc})))
		}
		for _, name := range allPaths {
			p := e.paths[name]
			r := e.measure(p, loadRequest{Op: "rr", Addr: p.echo, Count: s.rtts})
			p50[name] = append(p50[name], us(percentile(r.RTTs, 50)))
			p90[name] = append(p90[name], us(percentile(r.RTTs, 90)))
			p99[name] = append(p99[name], us(percentile(r.RTTs, 99)))
		}
		for _, name := range allPaths {
			p := e.paths[name]
			r := e.measure(p, loadRequest{Op: "bulk", Addr: p.sink, Duration: s.duration})
			tput[name] = append(tput[name], float64(r.Bytes)*8/r.Elapsed.Seconds()/1e9)
		}
		slog.Info("traffic repetition done", "rep", rep+1, "of", s.reps,
			"conn_seq", last(seq), "conn_conc", last(conc), "rr_p50_us", last(p50), "gbit", last(tput))
	}
	res.Figures = append(res.Figures,
		newFigure("conn_rate_seq", "conn/s", "higher", ">= 1.3x iptables", seq),
		newFigure("conn_rate_conc", "conn/s", "higher", ">= 1.3x iptables", conc),
		newFigure("conn_cpu_us", "us CPU/conn", "lower", "", cpuPerConn),
		newFigure("rr_latency_p50", "us", "lower", "<= 0.8x iptables", p50),
		newFigure("rr_latency_p90", "us", "lower", "", p90),
		newFigure("rr_latency_p99", "us", "lower", "<= 0.8x iptables", p99),
		newFigure("throughput", "Gbit/s", "higher", "", tput),
	)
	for _, name := range []string{pathIptables, pathEBPF} {
		if sm := summarize(ztPerConn[name]); sm != nil {
			res.Notes["stand-in CPU per connection, "+name] = fmt.Sprintf("%.0f us (median of the conn_rate_seq runs)", sm.Median)
		}
	}
}

func rate(r run) float64 { return float64(r.Conns) / r.Elapsed.Seconds() }

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// last returns each path's latest sample, for progress logs.
func last(m map[string][]float64) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		if len(v) > 0 {
			out[k] = benchdoc.Num(v[len(v)-1])
		}
	}
	return out
}
