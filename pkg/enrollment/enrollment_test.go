// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func pod(ns string, labels, annotations map[string]string, mutate ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: ns, Labels: labels, Annotations: annotations}}
	for _, m := range mutate {
		m(p)
	}
	return p
}

func namespace(labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns", Labels: labels}}
}

func TestDecide(t *testing.T) {
	ambient := map[string]string{DataplaneModeLabel: DataplaneModeAmbient}
	none := map[string]string{DataplaneModeLabel: DataplaneModeNone}
	runDecide(t, DefaultConfig(), []decideCase{
		{"pod label", pod("ns", ambient, nil), nil, true, ReasonPodLabel},
		{"namespace label", pod("ns", nil, nil), namespace(ambient), true, ReasonNamespaceLabel},
		{"namespace label, pod opts out", pod("ns", none, nil), namespace(ambient), false, ReasonOptedOut},
		{"no labels", pod("ns", nil, nil), namespace(nil), false, ReasonNotLabelled},
		{"unknown namespace", pod("ns", nil, nil), nil, false, ReasonNotLabelled},
		{"host network", pod("ns", ambient, nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true }), nil, false, ReasonHostNetwork},
		{"sidecar", pod("ns", ambient, map[string]string{SidecarStatusAnnotation: "{}"}), nil, false, ReasonSidecar},
		{"kube-system", pod("kube-system", ambient, nil), nil, false, ReasonExcludedNS},
		{"ztunnel", pod("istio-system", map[string]string{"app": "ztunnel", DataplaneModeLabel: "ambient"}, nil), nil, false, ReasonZtunnel},
		// As istio-cni: app=ztunnel outside the system namespace is an app
		// (test/differential's TestEnablementBothWays).
		{"app=ztunnel elsewhere", pod("ns", map[string]string{"app": "ztunnel"}, nil), namespace(ambient), true, ReasonNamespaceLabel},
		{"self", pod("istio-system", map[string]string{"app.kubernetes.io/name": "ambient-ebpf"}, nil), namespace(ambient), false, ReasonSelf},
		{"succeeded", pod("ns", ambient, nil, func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }), nil, false, ReasonTerminal},
	})
}

// decideCase is one pod for Decide and what it must decide.
type decideCase struct {
	name   string
	pod    *corev1.Pod
	ns     *corev1.Namespace
	want   bool
	reason Reason
}

func runDecide(t *testing.T, cfg Config, cases []decideCase) {
	t.Helper()
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if d := Decide(cfg, tc.pod, tc.ns); d.Ambient != tc.want || d.Reason != tc.reason {
				t.Errorf("Decide = %v (%s), want %v (%s)", d.Ambient, d.Reason, tc.want, tc.reason)
			}
		})
	}
}

func TestPodOptions(t *testing.T) {
	cfg := DefaultConfig()
	o := PodOptions(cfg, pod("ns", nil, map[string]string{
		BypassInboundAnnotation:     "true",
		DNSCaptureAnnotation:        "false",
		RerouteInterfacesAnnotation: " tun0, ,wg0",
	}))
	if !o.BypassInbound || o.DNSCapture || len(o.RerouteInterfaces) != 2 || o.RerouteInterfaces[1] != "wg0" {
		t.Errorf("PodOptions = %+v", o)
	}
	cfg.DNSCapture = false
	if o := PodOptions(cfg, pod("ns", nil, map[string]string{DNSCaptureAnnotation: "true"})); !o.DNSCapture {
		t.Errorf("dns-capture=true must override a false node default")
	}
}
