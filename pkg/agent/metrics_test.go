// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	dto "github.com/prometheus/client_model/go"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
)

// docMetric is one row of docs/METRICS.md.
type docMetric struct {
	typ string
	// labels holds each label's documented values; nil for any value.
	labels map[string][]string
}

// readMetricsDoc parses the metric tables of docs/METRICS.md.
func readMetricsDoc(t *testing.T) map[string]docMetric {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", "METRICS.md"))
	if err != nil {
		t.Fatal(err)
	}
	label := regexp.MustCompile("`([a-z_]+)`(?: \\(([^)]*)\\))?")
	value := regexp.MustCompile("`([^`]+)`")
	out := map[string]docMetric{}
	inTable := false
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "| metric |") {
			inTable = true
			continue
		}
		if !strings.HasPrefix(line, "|") {
			inTable = false
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		if !inTable || strings.HasPrefix(cells[0], "---") {
			continue
		}
		if len(cells) < 4 {
			t.Fatalf("METRICS.md row with %d cells: %s", len(cells), line)
		}
		name := strings.Trim(strings.TrimSpace(cells[0]), "`")
		m := docMetric{typ: strings.TrimSpace(cells[1]), labels: map[string][]string{}}
		for _, l := range label.FindAllStringSubmatch(cells[2], -1) {
			var vals []string
			for _, v := range value.FindAllStringSubmatch(l[2], -1) {
				vals = append(vals, v[1])
			}
			m.labels[l[1]] = vals
		}
		if _, dup := out[name]; dup {
			t.Errorf("METRICS.md lists %s twice", name)
		}
		out[name] = m
	}
	if len(out) == 0 {
		t.Fatal("METRICS.md has no metric tables")
	}
	return out
}

// fakeStats is a data path with pods and their counters.
type fakeStats struct {
	mu    sync.Mutex
	pods  []inspect.EnrolledPod
	stats map[string]inspect.Stats
}

func (f *fakeStats) List() []inspect.EnrolledPod {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.pods)
}

func (f *fakeStats) Stats(uid string) (inspect.Stats, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.stats[uid]
	if !ok {
		return s, errors.New("not enrolled")
	}
	return s, nil
}

func (f *fakeStats) remove(uid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pods = slices.DeleteFunc(f.pods, func(p inspect.EnrolledPod) bool { return p.UID == uid })
	delete(f.stats, uid)
}

func onePod() *fakeStats {
	return &fakeStats{
		pods:  []inspect.EnrolledPod{{UID: "u1", Namespace: "shop", Name: "web"}},
		stats: map[string]inspect.Stats{"u1": {OutboundRedirects: 3, InboundRedirects: 2, DNSRedirects: 1, InboundNoListener: 1}},
	}
}

// gathered is what a registry exposes: by metric, its type and each
// label's values.
type gathered map[string]struct {
	typ    string
	labels map[string]map[string]bool
}

func gather(t *testing.T, m *metrics, into gathered) {
	t.Helper()
	fams, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	types := map[dto.MetricType]string{dto.MetricType_COUNTER: "counter", dto.MetricType_GAUGE: "gauge", dto.MetricType_HISTOGRAM: "histogram"}
	for _, f := range fams {
		g := into[f.GetName()]
		g.typ = types[f.GetType()]
		if g.labels == nil {
			g.labels = map[string]map[string]bool{}
		}
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if g.labels[l.GetName()] == nil {
					g.labels[l.GetName()] = map[string]bool{}
				}
				g.labels[l.GetName()][l.GetValue()] = true
			}
		}
		into[f.GetName()] = g
	}
}

// istioCNI are istio-cni's metrics with the label values its node agent
// uses (cni/pkg/install, cni/pkg/nodeagent, cni/pkg/repair): the docs must
// keep them.
var istioCNI = map[string]map[string][]string{
	"istio_cni_installs_total":             {"result": {"SUCCESS", "COPY_BINARIES_FAILURE", "CREATE_KUBECONFIG_FAILURE", "CREATE_CNI_CONFIG_FAILURE"}},
	"istio_cni_install_ready":              {},
	"istio_cni_plugin_requests_total":      {"response_code": {"200", "400", "500"}},
	"istio_cni_repair_pods_repaired_total": {"type": {"repair", "delete", "label"}, "result": {"success", "skip", "fail"}},
	"nodeagent_reconcile_events_total":     {"type": {"add", "update", "delete"}},
	"ztunnel_connected":                    {},
}

// Every metric the agent registers is in docs/METRICS.md with its type,
// labels and every label value, present before any event; per-pod series
// only with --per-pod-metrics; istio-cni's rows as istio-cni has them.
// isRuntimeMetric reports the Go runtime's and the process's metrics.
func isRuntimeMetric(name string) bool {
	return strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_")
}

func TestMetricsMatchTheDocs(t *testing.T) {
	doc := readMetricsDoc(t)
	for name, labels := range istioCNI {
		d, ok := doc[name]
		if !ok {
			t.Errorf("METRICS.md lacks istio-cni's %s", name)
			continue
		}
		if !maps.EqualFunc(d.labels, labels, slices.Equal) {
			t.Errorf("METRICS.md: %s labels %v, istio-cni has %v", name, d.labels, labels)
		}
	}

	// The union over every repair mode, per-pod series on, with a pod.
	got := gathered{}
	for _, mode := range []kube.RepairMode{kube.RepairInPlace, kube.RepairDelete, kube.RepairLabel} {
		m := newMetrics(mode, true)
		m.bpf.setSource(onePod())
		gather(t, m, got)
	}
	for _, want := range []string{"go_goroutines", "process_open_fds", "process_resident_memory_bytes"} {
		if _, ok := got[want]; !ok {
			t.Errorf("the agent has no %s", want)
		}
	}
	for name, g := range got {
		if isRuntimeMetric(name) {
			continue // client_golang's collectors, documented as a whole
		}
		d, ok := doc[name]
		if !ok {
			t.Errorf("%s is not in METRICS.md", name)
			continue
		}
		if g.typ != d.typ {
			t.Errorf("%s is a %s, METRICS.md says %s", name, g.typ, d.typ)
		}
		if !slices.Equal(slices.Sorted(maps.Keys(g.labels)), slices.Sorted(maps.Keys(d.labels))) {
			t.Errorf("%s labels %v, METRICS.md says %v", name, slices.Sorted(maps.Keys(g.labels)), slices.Sorted(maps.Keys(d.labels)))
			continue
		}
		for l, vals := range d.labels {
			if vals == nil {
				continue
			}
			if have := slices.Sorted(maps.Keys(g.labels[l])); !slices.Equal(have, slices.Sorted(slices.Values(vals))) {
				t.Errorf("%s{%s} values %v from the start, METRICS.md says %v", name, l, have, vals)
			}
		}
	}
	for name := range doc {
		if _, ok := got[name]; !ok {
			t.Errorf("METRICS.md lists %s, the agent has no such series", name)
		}
	}

	// By default nothing names a pod, and no BPF error is counted as a
	// redirect.
	plain := gathered{}
	m := newMetrics(kube.RepairInPlace, false)
	m.bpf.setSource(onePod())
	gather(t, m, plain)
	for name, g := range plain {
		if _, ok := g.labels["pod"]; ok {
			t.Errorf("%s names pods without --per-pod-metrics", name)
		}
	}
	for _, k := range errorKinds {
		if got["ambient_ebpf_redirects_total"].labels["kind"][k.name] {
			t.Errorf("error kind %s counted in ambient_ebpf_redirects_total", k.name)
		}
	}
}

// sample reads one series of a gathered registry.
func sample(t *testing.T, m *metrics, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			if c := s.GetCounter(); c != nil {
				return c.GetValue()
			}
			return s.GetGauge().GetValue()
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

// The node totals keep the counts of pods that left the mesh.
func TestBPFTotalsKeepRemovedPods(t *testing.T) {
	m := newMetrics(kube.RepairInPlace, false)
	if v := sample(t, m, "ambient_ebpf_redirects_total", map[string]string{"kind": "outbound"}); v != 0 {
		t.Errorf("outbound before the data path = %v, want a zero series", v)
	}
	src := onePod()
	m.bpf.setSource(src)
	m.bpf.retire("u1")
	src.remove("u1")
	for _, c := range []struct {
		name, kind string
		want       float64
	}{
		{"ambient_ebpf_redirects_total", "outbound", 3},
		{"ambient_ebpf_redirects_total", "dns", 1},
		{"ambient_ebpf_bpf_errors_total", "inbound_no_listener", 1},
	} {
		if got := sample(t, m, c.name, map[string]string{"kind": c.kind}); got != c.want {
			t.Errorf("%s{kind=%s} after the pod left = %v, want %v", c.name, c.kind, got, c.want)
		}
	}
}

// Answers to the CNI plugin count under istio-cni's response codes.
func TestCNIAnswersCountAsIstioResponseCodes(t *testing.T) {
	m := newMetrics(kube.RepairInPlace, false)
	for _, c := range []cniv1.Code{cniv1.CodeOK, cniv1.CodeInvalidArgument, cniv1.CodeInternal, cniv1.CodeNoZtunnel, cniv1.CodeDeadlineExceeded} {
		m.observeCNI("add", c)
	}
	m.observeCNI("del", cniv1.CodeOK)
	for code, want := range map[string]float64{"200": 1, "400": 1, "500": 3} {
		if got := sample(t, m, "istio_cni_plugin_requests_total", map[string]string{"response_code": code}); got != want {
			t.Errorf("istio_cni_plugin_requests_total{response_code=%s} = %v, want %v", code, got, want)
		}
	}
	if got := sample(t, m, "ambient_ebpf_cni_del_requests_total", map[string]string{"response_code": "200"}); got != 1 {
		t.Errorf("ambient_ebpf_cni_del_requests_total{200} = %v, want 1", got)
	}
}
