// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// The churn run: a short-lived connection storm against pods whose
// conntrack tables are full.
const (
	// churnHeadroom is how many entries each pod's table has left when
	// the storm starts.
	churnHeadroom = 256
	churnConc     = 32
	// churnTimeout bounds each connection of the storm: a SYN that
	// conntrack dropped is sent again only after a second.
	churnTimeout  = time.Second
	churnDuration = 2 * time.Second
	// churnMaxFill keeps the run to a few seconds per path on machines
	// with a much larger nf_conntrack_max.
	churnMaxFill = 1 << 21
)

// churn holds each base lean path's client and server pod at a full
// conntrack table and counts the connections of a storm that fail. The
// limit, nf_conntrack_max, is global and writable only in the initial
// netns (read-only in every other on this kernel), but each netns's table
// counts its own entries against it, so a pod's table is filled in place:
// ctFill adds established, assured entries (what early drop and the
// garbage collector never evict) up to the limit less churnHeadroom, as a
// pod holding that many connections would. Nothing outside the two pods'
// netns is touched, and their tables are flushed afterwards.
func (e *env) churn(res *Results) {
	limit, err := ctMax()
	if err != nil {
		res.Notes["churn"] = "not measured: " + err.Error()
		return
	}
	if limit-churnHeadroom > churnMaxFill {
		res.Notes["churn"] = fmt.Sprintf("not measured: nf_conntrack_max is %d; filling a table takes too long", limit)
		return
	}
	fill := limit - churnHeadroom
	var base []leanVariant
	for _, v := range e.leanVariants(res) {
		if v.base() {
			base = append(base, v)
		}
	}
	failed, rates := map[string][]float64{}, map[string][]float64{}
	first := map[string]string{}
	var fillTime time.Duration
	for rep := range e.s.churnReps {
		for _, v := range base {
			pods := []string{v.path.client.NS, v.path.server.NS}
			t0 := time.Now()
			for _, ns := range pods {
				if err := ctFlush(ns); err != nil {
					e.t.Fatal(err)
				}
				if err := ctFill(ns, fill); err != nil {
					e.t.Fatal(err)
				}
				if n, err := ctCount(ns); err != nil || n < fill {
					e.t.Fatalf("conntrack of %s: %d entries after filling %d (%v)", ns, n, fill, err)
				}
			}
			fillTime += time.Since(t0)
			r := e.measureLean(v, loadRequest{Op: "conn", Addr: v.addr, Duration: churnDuration, Conc: churnConc, Timeout: churnTimeout, Storm: true})
			failed[v.name] = append(failed[v.name], float64(r.Failures))
			rates[v.name] = append(rates[v.name], rate(r.run()))
			if r.FirstError != "" && first[v.name] == "" {
				first[v.name] = r.FirstError
			}
			for _, ns := range pods {
				if err := ctFlush(ns); err != nil {
					e.t.Fatal(err)
				}
			}
		}
		slog.Info("churn repetition done", "rep", rep+1, "of", e.s.churnReps, "failed", last(failed), "conn_s", last(rates))
	}
	how := fmt.Sprintf("%d loops of connect, 64-byte request and response, close for %s, each connection given %s; "+
		"the client and the server pod's conntrack tables filled to nf_conntrack_max (%d) less %d with established, assured entries first; %d runs per path",
		churnConc, churnDuration, churnTimeout, limit, churnHeadroom, e.s.churnReps)
	res.Figures = append(res.Figures,
		newFigure("churn_failed_conns", "conns", "lower", "0 for ebpf where iptables fails", failed).WithNote("connections that failed or timed out in a storm: "+how),
		newFigure("churn_conn_rate", "conn/s", "higher", "", rates).WithNote("connections completed per second in the same storm"),
	)
	var firsts []string
	for _, v := range base {
		if f := first[v.name]; f != "" {
			firsts = append(firsts, v.name+": "+f)
		}
	}
	if len(firsts) > 0 {
		res.Notes["churn: first failure by path"] = strings.Join(firsts, "; ")
	}
	res.Notes["churn: filling the tables (ctnetlink, not timed)"] = fmt.Sprintf("%d entries per pod netns, %s per path on average",
		fill, (fillTime / time.Duration(max(1, e.s.churnReps*len(base)))).Round(time.Millisecond))
}
