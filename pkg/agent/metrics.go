// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/takeover"
)

// metrics uses istio-cni's names, labels and label values where Istio has
// the metric, so its dashboards and alerts read ours (docs/METRICS.md maps
// them, and a test holds both to each other), and ambient_ebpf_* for what
// is ours. Every series with a known label set exists from the start, at
// zero.
type metrics struct {
	reg *prometheus.Registry

	installs       *prometheus.CounterVec // istio_cni_installs_total{result}
	installReady   prometheus.Gauge       // istio_cni_install_ready
	pluginRequests *prometheus.CounterVec // istio_cni_plugin_requests_total{response_code}: ADDs
	repaired       *prometheus.CounterVec // istio_cni_repair_pods_repaired_total{type,result}
	reconcile      *prometheus.CounterVec // nodeagent_reconcile_events_total{type}
	ztunnel        prometheus.Gauge       // ztunnel_connected

	delRequests     *prometheus.CounterVec
	enrolled        prometheus.Gauge
	enrollSeconds   prometheus.Histogram
	removeSeconds   prometheus.Histogram
	dataplaneErrors *prometheus.CounterVec
	takeovers       *prometheus.CounterVec
	draining        prometheus.Gauge
	leftOnIstioCNI  prometheus.GaugeFunc
	istioCNIPods    atomic.Pointer[func() int] // counts them, once the reconciler exists
	handbacks       *prometheus.CounterVec
	noListener      prometheus.Gauge
	listenerEntries prometheus.Gauge
	refiled         prometheus.Counter
	pruned          prometheus.Counter
	bpf             *bpfCollector
	decisions       *decisionCollector
}

// Response codes of istio_cni_plugin_requests_total, as istio-cni answers
// its plugin over HTTP: 200, 400 for a request refused as malformed, 500
// for a pod that could not be enrolled.
var responseCodes = []string{"200", "400", "500"}

func responseCode(c cniv1.Code) string {
	switch c {
	case cniv1.CodeOK:
		return "200"
	case cniv1.CodeInvalidArgument:
		return "400"
	}
	return "500"
}

// newMetrics registers every metric; repair is the repair mode, whose
// istio_cni_repair_pods_repaired_total series exist from the start, and
// perPod adds the per-pod BPF counters.
func newMetrics(repair kube.RepairMode, perPod bool) *metrics {
	latency := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5}
	m := &metrics{
		reg: prometheus.NewRegistry(),
		installs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_installs_total",
			Help: "CNI plugin installs, by result: SUCCESS each time the installation becomes ready, the failing step otherwise."}, []string{"result"}),
		installReady: prometheus.NewGauge(prometheus.GaugeOpts{Name: "istio_cni_install_ready",
			Help: "1 when the CNI plugin is installed on the host."}),
		pluginRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_requests_total",
			Help: "Pod ADD requests from the CNI plugin, by response code (200, 400 refused as malformed, 500 not enrolled)."}, []string{"response_code"}),
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_repair_pods_repaired_total",
			Help: "Unredirected running pods repaired, by repair type and result."}, []string{"type", "result"}),
		reconcile: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "nodeagent_reconcile_events_total",
			Help: "Pod and namespace events the controller reconciled, by type (add, update, delete)."}, []string{"type"}),
		ztunnel: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ztunnel_connected",
			Help: "Number of ztunnel connections over ZDS."}),
		delRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ambient_ebpf_cni_del_requests_total",
			Help: "Pod DEL requests from the CNI plugin, by response code (200, 400 refused as malformed, 500 failed)."}, []string{"response_code"}),
		enrolled: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambient_ebpf_enrolled_pods",
			Help: "Pods whose traffic the data path redirects."}),
		enrollSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ambient_ebpf_enroll_duration_seconds",
			Help: "Time to redirect a pod and hand it to ztunnel.", Buckets: latency}),
		removeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ambient_ebpf_remove_duration_seconds",
			Help: "Time to remove a pod's redirection.", Buckets: latency}),
		dataplaneErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ambient_ebpf_dataplane_errors_total",
			Help: "Data path operations that failed, by operation (enroll, remove)."}, []string{"operation"}),
		takeovers: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ambient_ebpf_istio_cni_takeovers_total",
			Help: "Running pods taken over from istio-cni's rules, by result: taken_over (its rules are gone, eBPF redirects the pod), refused (rules not exactly istio-cni's: left on them), failed (a step failed; retried)."}, []string{"result"}),
		draining: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambient_ebpf_istio_cni_draining_pods",
			Help: "Pods taken over from istio-cni whose connections istio-cni redirected still run (their conntrack drain is in place)."}),
		handbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ambient_ebpf_istio_cni_handbacks_total",
			Help: "Pods handed back to istio-cni's rules on uninstall, by result (handed_back, failed: left on eBPF)."}, []string{"result"}),
		noListener: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambient_ebpf_pods_without_inbound_listener",
			Help: "Enrolled pods none of whose ztunnel inbound listeners is filed in ae_listeners at the last resync: their inbound connections are refused (ztunnel has not been handed the pod yet, or is down, or the table was full)."}),
		listenerEntries: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambient_ebpf_listener_table_entries",
			Help: "ztunnel inbound listeners filed in ae_listeners at the last resync, of 32768 (4 per enrolled pod at most)."}),
		refiled: prometheus.NewCounter(prometheus.CounterOpts{Name: "ambient_ebpf_listeners_refiled_total",
			Help: "Enrolled pods whose ztunnel inbound listener the agent's resync filed because none was (the table had no room when ztunnel listened)."}),
		pruned: prometheus.NewCounter(prometheus.CounterOpts{Name: "ambient_ebpf_listeners_pruned_total",
			Help: "ae_listeners entries of netns that are not enrolled, deleted by the agent (removed pods', or filed by an earlier agent's sockops for any netns)."}),
		bpf:       newBPFCollector(perPod),
		decisions: newDecisionCollector(),
	}
	m.leftOnIstioCNI = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "ambient_ebpf_istio_cni_pods",
		Help: "Pods istio-cni's rules still redirect (a takeover refused them, or has not inspected them yet); handed to ztunnel all the same."},
		func() float64 {
			if f := m.istioCNIPods.Load(); f != nil {
				return float64((*f)())
			}
			return 0
		})
	for _, r := range install.Results() {
		m.installs.WithLabelValues(r)
	}
	for _, c := range responseCodes {
		m.pluginRequests.WithLabelValues(c)
		m.delRequests.WithLabelValues(c)
	}
	if t := repair.MetricType(); t != "" {
		for _, r := range []string{kube.RepairResultSuccess, kube.RepairResultSkip, kube.RepairResultFail} {
			m.repaired.WithLabelValues(t, r)
		}
	}
	for _, t := range []string{"add", "update", "delete"} {
		m.reconcile.WithLabelValues(t)
	}
	for _, op := range []string{"enroll", "remove"} {
		m.dataplaneErrors.WithLabelValues(op)
	}
	for _, r := range []string{takeover.ResultTakenOver, takeover.ResultRefused, takeover.ResultFailed} {
		m.takeovers.WithLabelValues(r)
	}
	for _, r := range []string{takeover.ResultHandedBack, takeover.ResultHandFailed} {
		m.handbacks.WithLabelValues(r)
	}
	m.reg.MustRegister(m.installs, m.installReady, m.pluginRequests, m.repaired, m.reconcile, m.ztunnel,
		m.delRequests, m.enrolled, m.enrollSeconds, m.removeSeconds, m.dataplaneErrors,
		m.takeovers, m.draining, m.leftOnIstioCNI, m.handbacks, m.noListener, m.listenerEntries, m.refiled, m.pruned,
		m.bpf, m.decisions)
	// The Go runtime's and the process's own (go_*, process_*), which
	// a DaemonSet's dashboards expect: goroutines, heap, descriptors.
	m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// observeListeners records a listener resync (inspect.ListenerStatus).
func (m *metrics) observeListeners(st inspect.ListenerStatus) {
	m.noListener.Set(float64(len(st.Missing)))
	m.listenerEntries.Set(float64(st.Entries))
	m.refiled.Add(float64(st.Refiled))
	m.pruned.Add(float64(st.Pruned))
}

// observer is what the reconciler reports to the metrics.
func (m *metrics) observer() reconciler.Observer {
	return reconciler.Observer{
		Enrolled:       func(d time.Duration) { m.enrollSeconds.Observe(d.Seconds()) },
		Removing:       m.bpf.retire,
		Removed:        func(d time.Duration) { m.removeSeconds.Observe(d.Seconds()) },
		DataplaneError: func(op string) { m.dataplaneErrors.WithLabelValues(op).Inc() },
		Members:        func(n int) { m.enrolled.Set(float64(n)) },
	}
}

// observeCNI counts one answer to the CNI plugin (events.WithObserver).
func (m *metrics) observeCNI(method string, code cniv1.Code) {
	switch method {
	case "add":
		m.pluginRequests.WithLabelValues(responseCode(code)).Inc()
	case "del":
		m.delRequests.WithLabelValues(responseCode(code)).Inc()
	}
}

// bpfKind is one counter of a pod's ae_stats entry.
type bpfKind struct {
	name string
	get  func(inspect.Stats) uint64
}

// The ae_stats counters: redirections, and the errors the programs met.
var (
	redirectKinds = []bpfKind{
		{"outbound", func(s inspect.Stats) uint64 { return s.OutboundRedirects }},
		{"inbound", func(s inspect.Stats) uint64 { return s.InboundRedirects }},
		{"dns", func(s inspect.Stats) uint64 { return s.DNSRedirects }},
		{"reroute", func(s inspect.Stats) uint64 { return s.RerouteRedirects }},
		{"probe_snat", func(s inspect.Stats) uint64 { return s.ProbeSNAT }},
	}
	errorKinds = []bpfKind{
		{"inbound_no_listener", func(s inspect.Stats) uint64 { return s.InboundNoListener }},
		{"orig_dst_error", func(s inspect.Stats) uint64 { return s.OrigDstErrors }},
		{"probe_table_full", func(s inspect.Stats) uint64 { return s.ProbeNATFull }},
	}
)

// statsSource is where the BPF counters are read: the data path.
type statsSource interface {
	List() []inspect.EnrolledPod
	Stats(uid string) (inspect.Stats, error)
}

// bpfCollector reads the per-pod BPF counters (ae_stats) at scrape time.
// By default it exports node totals by kind; a pod's counters leave the
// maps with the pod, so the counts of pods removed since the agent started
// are kept (retire) and the totals only grow. With perPod it also exports
// each pod's counters under its namespace and name.
type bpfCollector struct {
	perPod                                  bool
	redirects, errors, podRedirects, podErr *prometheus.Desc

	mu      sync.Mutex
	src     statsSource       // nil until the data path is loaded
	retired map[string]uint64 // by kind name, the counts of removed pods
}

func newBPFCollector(perPod bool) *bpfCollector {
	podLabels := []string{"namespace", "pod", "kind"}
	return &bpfCollector{
		perPod: perPod,
		redirects: prometheus.NewDesc("ambient_ebpf_redirects_total",
			"Connections and DNS queries the BPF programs redirected on this node, by kind (ae_stats).", []string{"kind"}, nil),
		errors: prometheus.NewDesc("ambient_ebpf_bpf_errors_total",
			"Errors the BPF programs counted on this node, by kind (ae_stats).", []string{"kind"}, nil),
		podRedirects: prometheus.NewDesc("ambient_ebpf_pod_redirects_total",
			"Connections and DNS queries the BPF programs redirected, per pod and kind (ae_stats; --per-pod-metrics).", podLabels, nil),
		podErr: prometheus.NewDesc("ambient_ebpf_pod_bpf_errors_total",
			"Errors the BPF programs counted, per pod and kind (ae_stats; --per-pod-metrics).", podLabels, nil),
		retired: map[string]uint64{},
	}
}

// setSource starts reading the data path's counters.
func (c *bpfCollector) setSource(src statsSource) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.src = src
}

// retire keeps the counters of a pod about to be removed in the node
// totals.
func (c *bpfCollector) retire(uid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.src == nil {
		return
	}
	s, err := c.src.Stats(uid)
	if err != nil {
		return
	}
	for _, k := range slices.Concat(redirectKinds, errorKinds) {
		c.retired[k.name] += k.get(s)
	}
}

func (c *bpfCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.redirects
	ch <- c.errors
	if c.perPod {
		ch <- c.podRedirects
		ch <- c.podErr
	}
}

func (c *bpfCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	totals := map[string]uint64{}
	for k, v := range c.retired {
		totals[k] = v
	}
	var pods []inspect.EnrolledPod
	if c.src != nil {
		pods = c.src.List()
	}
	for _, p := range pods {
		s, err := c.src.Stats(p.UID)
		if err != nil {
			continue
		}
		for _, set := range []struct {
			desc  *prometheus.Desc
			kinds []bpfKind
		}{{c.podRedirects, redirectKinds}, {c.podErr, errorKinds}} {
			for _, k := range set.kinds {
				totals[k.name] += k.get(s)
				if c.perPod {
					ch <- prometheus.MustNewConstMetric(set.desc, prometheus.CounterValue, float64(k.get(s)), p.Namespace, p.Name, k.name)
				}
			}
		}
	}
	for _, k := range redirectKinds {
		ch <- prometheus.MustNewConstMetric(c.redirects, prometheus.CounterValue, float64(totals[k.name]), k.name)
	}
	for _, k := range errorKinds {
		ch <- prometheus.MustNewConstMetric(c.errors, prometheus.CounterValue, float64(totals[k.name]), k.name)
	}
}

var _ prometheus.Collector = (*bpfCollector)(nil)

// boolFloat is a gauge's value for b.
func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// decisionCollector reads the programs' decision counters (ae_decisions)
// at scrape time: the aggregate of what `ambient-ebpf trace` shows. Every
// series is there from the start, at zero until the data path is loaded.
type decisionCollector struct {
	mu         sync.Mutex
	src        decisionSource
	decisions  *prometheus.Desc
	lostEvents *prometheus.Desc
}

// decisionSource is the data path's side (*dataplane.Dataplane).
type decisionSource interface {
	Decisions() (inspect.Decisions, error)
}

func newDecisionCollector() *decisionCollector {
	return &decisionCollector{
		decisions: prometheus.NewDesc("ambient_ebpf_decisions_total",
			"Decisions the BPF programs made about enrolled pods' connections, by decision, reason and contract row (from ae_decisions).",
			[]string{"decision", "reason", "row"}, nil),
		lostEvents: prometheus.NewDesc("ambient_ebpf_trace_lost_events_total",
			"Trace events the BPF programs dropped because the ring buffer was full.", nil, nil)}
}

// setSource starts reading the data path's decision counters.
func (c *decisionCollector) setSource(src decisionSource) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.src = src
}

func (c *decisionCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.decisions
	ch <- c.lostEvents
}

func (c *decisionCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	src := c.src
	c.mu.Unlock()
	var d inspect.Decisions
	if src != nil {
		var err error
		if d, err = src.Decisions(); err != nil {
			return
		}
	}
	for _, r := range inspect.Reasons() {
		if r == inspect.ReasonForwarded || r == inspect.ReasonNotEnrolled {
			continue // traced, never counted
		}
		ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue, float64(d.ByReason[r]), r.Decision().String(), r.String(), r.Row())
	}
	ch <- prometheus.MustNewConstMetric(c.lostEvents, prometheus.CounterValue, float64(d.Lost))
}
