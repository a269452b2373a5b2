// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The three paths through the stand-in, in the order repetitions
// alternate them, and the lean paths (direct again, then both backends
// through lean proxies).
const (
	pathDirect       = "direct"
	pathIptables     = "iptables"
	pathEBPF         = "ebpf"
	pathIptablesLean = "iptables-lean"
	pathEBPFLean     = "ebpf-lean"
)

var (
	allPaths  = []string{pathDirect, pathIptables, pathEBPF}
	leanPaths = []string{pathDirect, pathIptablesLean, pathEBPFLean}
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
	// direct+proxy (the direct pair through the lean proxies, addressed
	// explicitly).
	Variants         map[string]*Summary `json:"variants,omitempty"`
	RatioVariantEBPF map[string]float64  `json:"ratio_variant_ebpf,omitempty"`
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

func summarize(samples []float64) *Summary {
	if len(samples) == 0 {
		return nil
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return &Summary{Median: med, Min: s[0], Max: s[len(s)-1], Samples: samples}
}

// newFigure builds a figure from per-path samples (paths without samples
// are left out; keys other than direct, iptables and ebpf are variants of
// ebpf) and the ratios of the medians where both sides exist.
func newFigure(name, unit, better, target string, samples map[string][]float64) Figure {
	f := Figure{Name: name, Unit: unit, Better: better, Target: target,
		Direct: summarize(samples[pathDirect]), Iptables: summarize(samples[pathIptables]), EBPF: summarize(samples[pathEBPF])}
	ratio := func(a, b *Summary) *float64 {
		if a == nil || b == nil || b.Median == 0 {
			return nil
		}
		r := a.Median / b.Median
		return &r
	}
	f.RatioEBPFIptables = ratio(f.EBPF, f.Iptables)
	f.RatioEBPFDirect = ratio(f.EBPF, f.Direct)
	for _, k := range slices.Sorted(maps.Keys(samples)) {
		if k == pathDirect || k == pathIptables || k == pathEBPF {
			continue
		}
		v := summarize(samples[k])
		if v == nil {
			continue
		}
		if f.Variants == nil {
			f.Variants, f.RatioVariantEBPF = map[string]*Summary{}, map[string]float64{}
		}
		f.Variants[k] = v
		if r := ratio(v, f.EBPF); r != nil && strings.HasPrefix(k, pathEBPF+"+") {
			f.RatioVariantEBPF[k] = *r
		}
	}
	return f
}

// withNote returns the figure with a note on how it is taken.
func (f Figure) withNote(note string) Figure {
	f.Note = note
	return f
}

// percentile of sorted durations, nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p/100*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// gitCommit names the checkout the benchmark runs in: HEAD, "-dirty" when
// a tracked file differs from it.
func gitCommit() string {
	out, err := exec.Command("git", "rev-parse", "HEAD").Output()
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	commit := strings.TrimSpace(string(out))
	status, err := exec.Command("git", "status", "--porcelain", "--untracked-files=no").Output()
	if err != nil || len(bytes.TrimSpace(status)) > 0 {
		commit += "-dirty"
	}
	return commit
}

func describeMachine() Machine {
	m := Machine{Cores: runtime.NumCPU(), GoVersion: runtime.Version(), Date: time.Now().UTC().Format(time.RFC3339)}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		m.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for l := range strings.Lines(string(b)) {
			if rest, ok := strings.CutPrefix(l, "model name"); ok {
				m.CPU = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(rest), ":"))
				break
			}
		}
	}
	return m
}

func readJSON(path string) (*Results, error) {
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

func writeJSON(path string, r *Results) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// Markers of the generated part of docs/BENCHMARKS.md; the text around
// them is written by hand and kept.
const (
	docBegin = "<!-- bench:begin (generated by make bench; edit outside these markers) -->"
	docEnd   = "<!-- bench:end -->"
)

// writeDoc replaces the generated section of the doc (or creates the doc).
func writeDoc(path string, r *Results) error {
	gen := docBegin + "\n" + markdown(r) + docEnd
	old, err := os.ReadFile(path)
	switch {
	case os.IsNotExist(err):
		old = []byte("# Benchmarks\n\n" + docBegin + "\n" + docEnd + "\n")
	case err != nil:
		return err
	}
	s := string(old)
	i, j := strings.Index(s, docBegin), strings.Index(s, docEnd)
	if i < 0 || j < i {
		return fmt.Errorf("%s: no generated section (markers %q ... %q)", path, docBegin, docEnd)
	}
	return os.WriteFile(path, []byte(s[:i]+gen+s[j+len(docEnd):]), 0o644)
}

func markdown(r *Results) string {
	var b strings.Builder
	m := r.Machine
	fmt.Fprintf(&b, "Run of %s at commit %s on %d cores (%s), kernel %s, %s.\n\n", m.Date, r.Commit, m.Cores, m.CPU, m.Kernel, m.GoVersion)
	keys := slices.Sorted(maps.Keys(r.Config))
	for _, k := range keys {
		fmt.Fprintf(&b, "- %s: %s\n", k, r.Config[k])
	}
	b.WriteString("\nEach cell: median (min to max) over the repetitions. The `lean_*`, `redirect_*`, `conntrack_*` and `churn_*` figures go through " +
		"the lean proxy (iptables: the iptables-lean pair, ebpf: the ebpf-lean pair). Variants are more columns of the same repetitions: " +
		"direct+proxy, the direct pair through the same lean proxies addressed explicitly (no redirection), and variants of the ebpf-lean pair " +
		"(ebpf+trace: someone tracing), with their ratio to ebpf.\n\n")
	b.WriteString("| figure | unit | better | direct | iptables | ebpf | ebpf / iptables | ebpf / direct | variants | target |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, f := range r.Figures {
		var vs []string
		for _, k := range slices.Sorted(maps.Keys(f.Variants)) {
			v := k + ": " + cell(f.Variants[k])
			if rv, ok := f.RatioVariantEBPF[k]; ok {
				v += fmt.Sprintf(", %.2fx ebpf", rv)
			}
			vs = append(vs, v)
		}
		variants := "-"
		if len(vs) > 0 {
			variants = strings.Join(vs, "; ")
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", f.Name, f.Unit, f.Better,
			cell(f.Direct), cell(f.Iptables), cell(f.EBPF), ratioCell(f.RatioEBPFIptables), ratioCell(f.RatioEBPFDirect), variants, f.Target)
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

func cell(s *Summary) string {
	if s == nil {
		return "-"
	}
	if s.Min == s.Max {
		return num(s.Median)
	}
	return fmt.Sprintf("%s (%s to %s)", num(s.Median), num(s.Min), num(s.Max))
}

func ratioCell(r *float64) string {
	if r == nil {
		return "-"
	}
	return fmt.Sprintf("%.2fx", *r)
}

// num prints three significant digits.
func num(v float64) string {
	switch a := max(v, -v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.3g", v)
	}
}
