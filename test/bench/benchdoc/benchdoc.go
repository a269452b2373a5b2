// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package benchdoc is bench/results.json and what is written from it: the
// full table of docs/BENCHMARKS.md and the summary table that heads it and
// the README. `make bench` writes them after a run (test/bench), and
// `go run ./hack/benchdoc` rewrites them from the committed results.json
// without running anything; the package's test fails when a committed
// section differs from what the committed results.json gives, so no figure
// is restated by hand.
package benchdoc

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Summary is one path's repetitions of a figure.
type Summary struct {
	Median  float64   `json:"median"`
	Min     float64   `json:"min"`
	Max     float64   `json:"max"`
	Samples []float64 `json:"samples"`
}

// Figure is one line of bench/results.json (schema of issue 8).
type Figure struct {
	Name              string   `json:"name"`
	Unit              string   `json:"unit"`
	Better            string   `json:"better"` // higher or lower
	Direct            *Summary `json:"direct,omitempty"`
	Iptables          *Summary `json:"iptables,omitempty"`
	EBPF              *Summary `json:"ebpf,omitempty"`
	RatioEBPFIptables *float64 `json:"ratio_ebpf_iptables,omitempty"`
	RatioEBPFDirect   *float64 `json:"ratio_ebpf_direct,omitempty"`
	// Variants are more columns measured in the same repetitions, by
	// name: variants of the ebpf path (ebpf+trace: someone tracing; an
	// agent flag's variant), with the ratio of each median to ebpf's, and
	// the baselines direct+proxy and direct+transparent (the direct pair
	// through the lean proxies, addressed explicitly; the latter doing
	// ztunnel's socket work too), with the ratio of ebpf's median to each.
	Variants          map[string]*Summary `json:"variants,omitempty"`
	RatioVariantEBPF  map[string]float64  `json:"ratio_variant_ebpf,omitempty"`
	RatioEBPFBaseline map[string]float64  `json:"ratio_ebpf_baseline,omitempty"`
	// Target is the goal for this figure, for the table.
	Target string `json:"target,omitempty"`
	// Note says how the figure is measured where the table cannot.
	Note string `json:"note,omitempty"`
}

// Machine describes where the run happened.
type Machine struct {
	Cores     int    `json:"cores"`
	CPU       string `json:"cpu"`
	Kernel    string `json:"kernel"`
	GoVersion string `json:"go"`
	Date      string `json:"date"`
}

// Results is bench/results.json.
type Results struct {
	// Commit is the git commit the run measured, with "-dirty" when
	// tracked files differed from it.
	Commit  string            `json:"commit"`
	Machine Machine           `json:"machine"`
	Config  map[string]string `json:"config"`
	Figures []Figure          `json:"figures"`
	// Notes are measured facts the doc explains (program run times,
	// stand-in CPU per connection, ...), by key.
	Notes map[string]string `json:"notes,omitempty"`
	// Distributions are every sample of a latency, by name and path, for
	// the chart (enroll_cni_ms: each CNI ADD of every repetition).
	Distributions map[string]map[string][]float64 `json:"distributions,omitempty"`
}

// WithNote returns the figure with a note on how it is taken.
func (f Figure) WithNote(note string) Figure {
	f.Note = note
	return f
}

// ReadJSON reads a results file.
func ReadJSON(path string) (*Results, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Results
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &r, nil
}

// WriteJSON writes a results file, indented, creating its directory.
func WriteJSON(path string, r *Results) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

func Markdown(r *Results) string {
	var b strings.Builder
	m := r.Machine
	fmt.Fprintf(&b, "Run of %s at commit %s on %d cores (%s), kernel %s, %s.\n\n", m.Date, r.Commit, m.Cores, m.CPU, m.Kernel, m.GoVersion)
	keys := slices.Sorted(maps.Keys(r.Config))
	for _, k := range keys {
		fmt.Fprintf(&b, "- %s: %s\n", k, r.Config[k])
	}
	b.WriteString("\nEach cell: median (min to max) over the repetitions. The `lean_*`, `redirect_*`, `conntrack_*` and `churn_*` figures go through " +
		"the lean proxy (iptables: the iptables-lean pair, ebpf: the ebpf-lean pair). Variants are more columns of the same repetitions: " +
		"direct+proxy, the direct pair through the same lean proxies addressed explicitly (no redirection), direct+transparent, the same with " +
		"ztunnel's socket work (SO_ORIGINAL_DST asked, the inbound upstream transparent from the client's address), each with ebpf's ratio " +
		"to it, and variants of the ebpf-lean pair (ebpf+trace: someone tracing), with their ratio to ebpf.\n\n")
	b.WriteString("| figure | unit | better | direct | iptables | ebpf | ebpf / iptables | ebpf / direct | variants | target |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, f := range r.Figures {
		var vs []string
		for _, k := range slices.Sorted(maps.Keys(f.Variants)) {
			v := k + ": " + Cell(f.Variants[k])
			if rv, ok := f.RatioVariantEBPF[k]; ok {
				v += fmt.Sprintf(", %.2fx ebpf", rv)
			}
			if rb, ok := f.RatioEBPFBaseline[k]; ok {
				v += fmt.Sprintf(", ebpf %.2fx", rb)
			}
			vs = append(vs, v)
		}
		variants := "-"
		if len(vs) > 0 {
			variants = strings.Join(vs, "; ")
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", f.Name, f.Unit, f.Better,
			Cell(f.Direct), Cell(f.Iptables), Cell(f.EBPF), RatioCell(f.RatioEBPFIptables), RatioCell(f.RatioEBPFDirect), variants, f.Target)
	}
	var notes []string
	for _, f := range r.Figures {
		if f.Note != "" {
			notes = append(notes, fmt.Sprintf("- `%s`: %s\n", f.Name, f.Note))
		}
	}
	if len(notes) > 0 {
		b.WriteString("\nHow the figures are taken:\n\n")
		b.WriteString(strings.Join(notes, ""))
	}
	if len(r.Notes) > 0 {
		b.WriteString("\nMeasured along the way:\n\n")
		for _, k := range slices.Sorted(maps.Keys(r.Notes)) {
			fmt.Fprintf(&b, "- %s: %s\n", k, r.Notes[k])
		}
	}
	return b.String()
}

// Cell is a summary as median (min to max).
func Cell(s *Summary) string {
	if s == nil {
		return "-"
	}
	if s.Min == s.Max {
		return Num(s.Median)
	}
	return fmt.Sprintf("%s (%s to %s)", Num(s.Median), Num(s.Min), Num(s.Max))
}

// RatioCell is a ratio of medians, or "-".
func RatioCell(r *float64) string {
	if r == nil {
		return "-"
	}
	return fmt.Sprintf("%.2fx", *r)
}

// Num prints three significant digits.
func Num(v float64) string {
	switch a := max(v, -v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.3g", v)
	}
}
