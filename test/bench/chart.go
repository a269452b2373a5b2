// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"image/color"
	"io"
	"maps"
	"math"
	"os"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// The chart of a run (bench/chart.svg, linked from docs/BENCHMARKS.md),
// drawn with gonum/plot: every figure's ratios as ebpf's advantage on a
// log axis, the conntrack and churn counts per path, and the distribution
// of CNI ADD latencies.

// Colours of the series (the Okabe-Ito palette, readable by colour-blind
// readers).
var (
	colIptables = color.RGBA{R: 0xd5, G: 0x5e, A: 0xff}
	colDirect   = color.RGBA{R: 0x56, G: 0xb4, B: 0xe9, A: 0xff}
	colVariant  = color.RGBA{R: 0x00, G: 0x9e, B: 0x73, A: 0xff}
	colEBPF     = color.RGBA{R: 0x00, G: 0x72, B: 0xb2, A: 0xff}
	colIstioCNI = color.RGBA{R: 0xe6, G: 0x9f, B: 0x00, A: 0xff} // the real istio-cni
)

// countFigures are drawn as counts per path rather than as ratios (ebpf's
// 0 has no ratio).
var countFigures = []string{"conntrack_entries_per_conn", "conntrack_node_entries_per_conn", "churn_failed_conns"}

// writeChart renders r's chart to path: SVG, or PNG for a path ending in
// .png.
func writeChart(path string, r *Results) error {
	ratios, err := ratioPlot(r)
	if err != nil {
		return err
	}
	counts, err := countPlot(r)
	if err != nil {
		return err
	}
	dist, err := distributionPlot(r)
	if err != nil {
		return err
	}
	rows := float64(len(ratioRows(r)))
	top := vg.Length(1.6+0.3*rows) * vg.Inch
	bottom := 3.6 * vg.Inch
	var c interface {
		vg.CanvasSizer
		io.WriterTo
	}
	if strings.HasSuffix(path, ".png") {
		c = vgimg.PngCanvas{Canvas: vgimg.New(11*vg.Inch, top+bottom)}
	} else {
		c = vgsvg.New(11*vg.Inch, top+bottom)
	}
	dc := draw.New(c)
	pad := 0.15 * vg.Inch
	ratios.Draw(draw.Crop(dc, pad, -pad, bottom+pad, -pad))
	lower := draw.Crop(dc, pad, -pad, pad, -top-pad)
	counts.Draw(draw.Crop(lower, 0, -5.6*vg.Inch, 0, 0))
	dist.Draw(draw.Crop(lower, 5.6*vg.Inch, 0, 0, 0))
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// ratioRow is one figure's line in the ratio plot.
type ratioRow struct {
	f     Figure
	label string
}

// ratioRows are the figures with a ratio to draw, in the results' order.
func ratioRows(r *Results) []ratioRow {
	var rows []ratioRow
	for _, f := range r.Figures {
		if slices.Contains(countFigures, f.Name) || f.EBPF == nil || (f.Iptables == nil && f.Direct == nil && len(f.Variants) == 0) {
			continue
		}
		arrow := "↑"
		if f.Better == "lower" {
			arrow = "↓"
		}
		rows = append(rows, ratioRow{f: f, label: f.Name + " " + arrow})
	}
	return rows
}

// advantage is how much better ebpf is than other, >1 when better: the
// ratio of the medians, turned round where lower is better, and the
// range of the per-repetition ratios (the samples of a figure's paths
// come from the same repetitions, in order).
func advantage(f Figure, other *Summary) (mid, lo, hi float64, ok bool) {
	if f.EBPF == nil || other == nil || f.EBPF.Median <= 0 || other.Median <= 0 {
		return 0, 0, 0, false
	}
	adv := func(e, o float64) float64 {
		if f.Better == "lower" {
			return o / e
		}
		return e / o
	}
	mid, lo, hi = adv(f.EBPF.Median, other.Median), math.Inf(1), math.Inf(-1)
	if n := min(len(f.EBPF.Samples), len(other.Samples)); n > 1 {
		for i := range n {
			if f.EBPF.Samples[i] > 0 && other.Samples[i] > 0 {
				a := adv(f.EBPF.Samples[i], other.Samples[i])
				lo, hi = min(lo, a), max(hi, a)
			}
		}
	}
	if math.IsInf(lo, 0) {
		lo, hi = mid, mid
	}
	return mid, lo, hi, true
}

// realIstioCNI says whether a figure's iptables column is the real
// istio-cni's (the *_istiocni figures).
func realIstioCNI(f Figure) bool { return strings.Contains(f.Name, "_istiocni") }

// ratioPlot draws, per figure, ebpf's advantage over iptables (or the
// real istio-cni) and over the direct path, and each variant's over plain ebpf (below 1: what the
// variant costs).
func ratioPlot(r *Results) (*plot.Plot, error) {
	rows := ratioRows(r)
	p := plot.New()
	p.Title.Text = fmt.Sprintf("ebpf's advantage per figure, > 1: ebpf better (run of %s at %s)\n"+
		"dot: ratio of the medians; whiskers: min to max of the per-repetition ratios", r.Machine.Date, shortCommit(r.Commit))
	p.X.Label.Text = "advantage, log scale: other / ebpf where lower is better (↓), ebpf / other where higher is better (↑)"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	n := len(rows)
	names := make([]string, n)
	for i, row := range rows {
		names[n-1-i] = row.label
	}
	p.NominalY(names...)
	series := []struct {
		name  string
		col   color.Color
		off   float64
		other func(Figure) *Summary // nil: the variants against ebpf
	}{
		{"ebpf vs iptables", colIptables, 0.22, func(f Figure) *Summary {
			if realIstioCNI(f) {
				return nil
			}
			return f.Iptables
		}},
		{"ebpf vs the real istio-cni", colIstioCNI, 0.22, func(f Figure) *Summary {
			if !realIstioCNI(f) {
				return nil
			}
			return f.Iptables
		}},
		{"ebpf vs direct (no mesh)", colDirect, 0, func(f Figure) *Summary { return f.Direct }},
		{"variant vs ebpf (ebpf+trace: someone tracing)", colVariant, -0.22, nil},
	}
	xmin, xmax := 0.5, 2.0
	for _, s := range series {
		var pts plotter.XYs
		var errs plotter.XErrors
		for i, row := range rows {
			y := float64(n-1-i) + s.off
			add := func(f Figure, other *Summary) {
				mid, lo, hi, ok := advantage(f, other)
				if !ok {
					return
				}
				pts = append(pts, plotter.XY{X: mid, Y: y})
				errs = append(errs, struct{ Low, High float64 }{mid - lo, hi - mid})
				xmin, xmax = min(xmin, lo), max(xmax, hi)
			}
			if s.other != nil {
				add(row.f, s.other(row.f))
				continue
			}
			// A variant's advantage over ebpf: ebpf's place taken by the variant.
			for _, k := range slices.Sorted(maps.Keys(row.f.RatioVariantEBPF)) {
				vf := row.f
				vf.EBPF = row.f.Variants[k]
				add(vf, row.f.EBPF)
			}
		}
		if len(pts) == 0 {
			continue
		}
		sc, err := plotter.NewScatter(pts)
		if err != nil {
			return nil, err
		}
		sc.GlyphStyle.Color, sc.GlyphStyle.Radius, sc.GlyphStyle.Shape = s.col, vg.Points(3), draw.CircleGlyph{}
		eb, err := plotter.NewXErrorBars(struct {
			plotter.XYs
			plotter.XErrors
		}{pts, errs})
		if err != nil {
			return nil, err
		}
		eb.LineStyle.Color, eb.LineStyle.Width = s.col, vg.Points(1)
		p.Add(eb, sc)
		p.Legend.Add(s.name, sc)
	}
	one, err := plotter.NewLine(plotter.XYs{{X: 1, Y: -0.5}, {X: 1, Y: float64(n) - 0.5}})
	if err != nil {
		return nil, err
	}
	one.LineStyle.Dashes, one.LineStyle.Color = []vg.Length{vg.Points(3), vg.Points(3)}, color.Gray{Y: 0x80}
	p.Add(one, plotter.NewGrid())
	p.X.Min, p.X.Max = xmin/1.2, xmax*1.2
	p.Legend.Top, p.Legend.Left = false, false
	return p, nil
}

// countPlot draws the count figures per path, as grouped bars.
func countPlot(r *Results) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "conntrack entries per connection (pod netns, node netns);\nfailed connections of a churn storm / 10 (medians)"
	var figs []Figure
	for _, name := range countFigures {
		if i := slices.IndexFunc(r.Figures, func(f Figure) bool { return f.Name == name }); i >= 0 {
			figs = append(figs, r.Figures[i])
		}
	}
	if len(figs) == 0 {
		p.Title.Text += ": not measured in this run"
		return p, nil
	}
	labels := make([]string, len(figs))
	for i, f := range figs {
		labels[i] = strings.ReplaceAll(strings.TrimSuffix(f.Name, "_per_conn"), "_", " ")
		if f.Name == "churn_failed_conns" {
			labels[i] += " / 10"
		}
	}
	paths := []struct {
		name string
		col  color.Color
		get  func(Figure) *Summary
	}{
		{pathDirect, colDirect, func(f Figure) *Summary { return f.Direct }},
		{pathIptables, colIptables, func(f Figure) *Summary { return f.Iptables }},
		{pathEBPF, colEBPF, func(f Figure) *Summary { return f.EBPF }},
	}
	w := vg.Points(14)
	top := 1.0
	for i, pt := range paths {
		vals := make(plotter.Values, len(figs))
		for j, f := range figs {
			if s := pt.get(f); s != nil {
				vals[j] = s.Median
				if f.Name == "churn_failed_conns" {
					vals[j] /= 10
				}
				top = max(top, vals[j])
			}
		}
		bars, err := plotter.NewBarChart(vals, w)
		if err != nil {
			return nil, err
		}
		bars.Color, bars.LineStyle.Width, bars.Offset = pt.col, 0, w*vg.Length(i-1)
		p.Add(bars)
		p.Legend.Add(pt.name, bars)
	}
	p.NominalX(labels...)
	p.Legend.Top, p.Legend.Left = true, true
	p.Y.Min, p.Y.Max = 0, top*1.3
	return p, nil
}

// distributionPlot draws box plots of every CNI ADD's latency per path.
func distributionPlot(r *Results) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "CNI ADD latency, exec to redirection in place\n(enroll_cni, every ADD of the repetitions)"
	p.Y.Label.Text = "ms"
	dist := r.Distributions["enroll_cni_ms"]
	var names []string
	for i, name := range []string{pathIptables, pathEBPF, pathIstioCNI} {
		vals := dist[name]
		if len(vals) == 0 {
			continue
		}
		bp, err := plotter.NewBoxPlot(vg.Points(40), float64(len(names)), plotter.Values(vals))
		if err != nil {
			return nil, err
		}
		bp.FillColor = []color.Color{colIptables, colEBPF, colIstioCNI}[i]
		p.Add(bp)
		names = append(names, fmt.Sprintf("%s (%d ADDs)", name, len(vals)))
	}
	if len(names) == 0 {
		p.Title.Text += ": not measured in this run"
		return p, nil
	}
	p.NominalX(names...)
	p.Y.Min = 0
	return p, nil
}

// shortCommit shortens a full commit hash, keeping a "-dirty" mark.
func shortCommit(c string) string {
	if len(c) >= 40 {
		return c[:12] + c[40:]
	}
	return c
}
