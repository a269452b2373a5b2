// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
)

// metrics uses istio-cni's names where Istio has one (docs/METRICS.md maps
// them) and ambient_ebpf_* for what is ours.
type metrics struct {
	reg *prometheus.Registry

	installs       *prometheus.CounterVec // istio_cni_installs_total{result}
	installReady   prometheus.Gauge       // istio_cni_install_ready
	pluginRequests *prometheus.CounterVec // istio_cni_plugin_requests_total{type,response_code}
	reconcile      *prometheus.CounterVec // nodeagent_reconcile_events_total{type}
	ztunnel        prometheus.Gauge       // ztunnel_connected

	enrolled        prometheus.Gauge
	enrollSeconds   prometheus.Histogram
	removeSeconds   prometheus.Histogram
	dataplaneErrors *prometheus.CounterVec
}

func newMetrics() *metrics {
	latency := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5}
	m := &metrics{
		reg: prometheus.NewRegistry(),
		installs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_installs_total",
			Help: "CNI plugin install passes, by result."}, []string{"result"}),
		installReady: prometheus.NewGauge(prometheus.GaugeOpts{Name: "istio_cni_install_ready",
			Help: "1 when the CNI plugin is installed on the host."}),
		pluginRequests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "istio_cni_plugin_requests_total",
			Help: "Pod ADD and DEL requests from the CNI plugin, by type and response code."}, []string{"type", "response_code"}),
		reconcile: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "nodeagent_reconcile_events_total",
			Help: "Pod and namespace events the controller reconciled, by type (add, update, delete, namespace)."}, []string{"type"}),
		ztunnel: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ztunnel_connected",
			Help: "1 while at least one ztunnel is connected over ZDS."}),
		enrolled: prometheus.NewGauge(prometheus.GaugeOpts{Name: "ambient_ebpf_enrolled_pods",
			Help: "Pods whose traffic the data path redirects."}),
		enrollSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ambient_ebpf_enroll_duration_seconds",
			Help: "Time to redirect a pod and hand it to ztunnel.", Buckets: latency}),
		removeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "ambient_ebpf_remove_duration_seconds",
			Help: "Time to remove a pod's redirection.", Buckets: latency}),
		dataplaneErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "ambient_ebpf_dataplane_errors_total",
			Help: "Data path operations that failed, by operation."}, []string{"reason"}),
	}
	m.reg.MustRegister(m.installs, m.installReady, m.pluginRequests, m.reconcile, m.ztunnel,
		m.enrolled, m.enrollSeconds, m.removeSeconds, m.dataplaneErrors)
	return m
}

// redirectCollector reads the per-pod BPF counters at scrape time.
type redirectCollector struct {
	dp   *dataplane.Dataplane
	desc *prometheus.Desc
}

func newRedirectCollector(dp *dataplane.Dataplane) *redirectCollector {
	return &redirectCollector{dp: dp, desc: prometheus.NewDesc("ambient_ebpf_redirects_total",
		"Connections and queries the BPF programs redirected, per pod and kind (from ae_stats).",
		[]string{"namespace", "pod", "kind"}, nil)}
}

func (c *redirectCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *redirectCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.dp.List() {
		s, err := c.dp.Stats(p.UID)
		if err != nil {
			continue
		}
		for kind, v := range map[string]uint64{
			"outbound": s.OutboundRedirects, "inbound": s.InboundRedirects, "dns": s.DNSRedirects,
			"reroute": s.RerouteRedirects, "probe_snat": s.ProbeSNAT, "inbound_no_listener": s.InboundNoListener,
			"orig_dst_error": s.OrigDstErrors, "probe_table_full": s.ProbeNATFull,
		} {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(v), p.Namespace, p.Name, kind)
		}
	}
}

// decisionCollector reads the programs' decision counters (ae_decisions)
// at scrape time: the aggregate of what `ambient-ebpf trace` shows.
type decisionCollector struct {
	dp         *dataplane.Dataplane
	decisions  *prometheus.Desc
	lostEvents *prometheus.Desc
}

func newDecisionCollector(dp *dataplane.Dataplane) *decisionCollector {
	return &decisionCollector{dp: dp,
		decisions: prometheus.NewDesc("ambient_ebpf_decisions_total",
			"Decisions the BPF programs made about enrolled pods' connections, by decision, reason and contract row (from ae_decisions).",
			[]string{"decision", "reason", "row"}, nil),
		lostEvents: prometheus.NewDesc("ambient_ebpf_trace_lost_events_total",
			"Trace events the BPF programs dropped because the ring buffer was full.", nil, nil)}
}

func (c *decisionCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.decisions
	ch <- c.lostEvents
}

func (c *decisionCollector) Collect(ch chan<- prometheus.Metric) {
	d, err := c.dp.Decisions()
	if err != nil {
		return
	}
	for _, r := range dataplane.Reasons() {
		if r == dataplane.ReasonForwarded || r == dataplane.ReasonNotEnrolled {
			continue // traced, never counted
		}
		ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue, float64(d.ByReason[r]), r.Decision().String(), r.String(), r.Row())
	}
	ch <- prometheus.MustNewConstMetric(c.lostEvents, prometheus.CounterValue, float64(d.Lost))
}
