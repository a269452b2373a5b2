// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
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
	// pathIstioCNI is the real istio-cni, a column of the enrolment
	// figures only (istioCNI).
	pathIstioCNI = "istio-cni"
)

var (
	allPaths  = []string{pathDirect, pathIptables, pathEBPF}
	leanPaths = []string{pathDirect, pathIptablesLean, pathEBPFLean}
)

// The results' types live in benchdoc, which renders them without the
// bench build tag (hack/benchdoc, its drift test).
type (
	Summary = benchdoc.Summary
	Figure  = benchdoc.Figure
	Machine = benchdoc.Machine
	Results = benchdoc.Results
)

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
		if r := ratio(f.EBPF, v); r != nil && strings.HasPrefix(k, pathDirect+"+") {
			if f.RatioEBPFBaseline == nil {
				f.RatioEBPFBaseline = map[string]float64{}
			}
			f.RatioEBPFBaseline[k] = *r
		}
	}
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

// writeDoc rewrites the generated sections of the results page and of the
// README (readme empty: none). A results page that does not exist yet, a
// partial run's, is created with both sections.
func writeDoc(doc, readme string, r *Results) error {
	if _, err := os.Stat(doc); os.IsNotExist(err) {
		skel := "# Benchmarks\n\n"
		for _, s := range []benchdoc.Section{benchdoc.SummaryTable, benchdoc.FullTable} {
			skel += s.Begin + "\n" + s.End + "\n\n"
		}
		if err := os.WriteFile(doc, []byte(skel), 0o644); err != nil {
			return err
		}
	}
	return benchdoc.Files{Benchmarks: doc, Readme: readme}.Write(r)
}
