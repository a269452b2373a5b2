// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package enrollment decides which pods belong in the ambient mesh and with
// which per-pod options (contract section 5 and rows R12-R14). It is pure: the
// agent's informers, the standalone pod file and the CNI plugin's fallback
// read all feed it the same Pod and Namespace objects.
package enrollment

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// Labels and annotations of the ambient contract.
const (
	DataplaneModeLabel   = "istio.io/dataplane-mode"
	DataplaneModeAmbient = "ambient"
	DataplaneModeNone    = "none"

	SidecarStatusAnnotation     = "sidecar.istio.io/status"
	RedirectionAnnotation       = "ambient.istio.io/redirection"
	BypassInboundAnnotation     = "ambient.istio.io/bypass-inbound-capture"
	DNSCaptureAnnotation        = "ambient.istio.io/dns-capture"
	RerouteInterfacesAnnotation = "istio.io/reroute-virtual-interfaces"
)

// Redirection is a pod's redirection state, as the agent publishes it in
// the ambient.istio.io/redirection annotation (None: no annotation).
type Redirection string

const (
	// RedirectionNone: the data path does not redirect the pod.
	RedirectionNone Redirection = ""
	// RedirectionPending: traffic is redirected, ztunnel has not acked
	// the pod.
	RedirectionPending Redirection = "pending"
	// RedirectionEnabled: redirected, and ztunnel acked the pod.
	RedirectionEnabled Redirection = "enabled"
)

// Config holds the node-wide selection settings.
type Config struct {
	// ExcludedNamespaces never have pods enrolled. Default: kube-system.
	ExcludedNamespaces []string
	// SelfLabels identify the agent's own pods (all must match). Empty matches nothing.
	SelfLabels map[string]string
	// ZtunnelLabels identify ztunnel's pods (all must match) in
	// ZtunnelNamespace, Istio's system namespace, as istio-cni identifies
	// them (SYSTEM_NAMESPACE): a pod labelled app=ztunnel elsewhere is
	// an app like any other. Default: app=ztunnel in istio-system; an
	// empty namespace matches the labels in every namespace.
	ZtunnelLabels    map[string]string
	ZtunnelNamespace string
	// DNSCapture is the node default for R9, overridable per pod (R13).
	DNSCapture bool
	// Selectors, when set, replace the label rule of contract section 5
	// (DefaultSelectors is that rule): a pod is ambient when one matches.
	// The exclusions (host network, sidecar, excluded namespaces, the
	// agent's and ztunnel's pods, terminated pods) hold either way.
	Selectors []Selector
}

// DefaultSystemNamespace is Istio's system namespace by default, where
// ztunnel runs.
const DefaultSystemNamespace = "istio-system"

// DefaultConfig returns the defaults of istio-cni.
func DefaultConfig() Config {
	return Config{
		ExcludedNamespaces: []string{"kube-system"},
		SelfLabels:         map[string]string{"app.kubernetes.io/name": "ambient-ebpf"},
		ZtunnelLabels:      map[string]string{"app": "ztunnel"},
		ZtunnelNamespace:   DefaultSystemNamespace,
		DNSCapture:         true,
	}
}

// Reason says why a pod is or is not enrolled; it is logged and reported.
type Reason string

const (
	ReasonPodLabel       Reason = "pod labelled ambient"
	ReasonNamespaceLabel Reason = "namespace labelled ambient"
	ReasonNotLabelled    Reason = "neither pod nor namespace labelled ambient"
	ReasonOptedOut       Reason = "pod labelled dataplane-mode=none"
	ReasonHostNetwork    Reason = "hostNetwork pod"
	ReasonSidecar        Reason = "pod has a sidecar"
	ReasonExcludedNS     Reason = "namespace excluded"
	ReasonSelf           Reason = "the agent's own pod"
	ReasonZtunnel        Reason = "ztunnel pod"
	ReasonTerminal       Reason = "pod terminated"
	ReasonSelected       Reason = "an enablement selector matches"
	ReasonNotSelected    Reason = "no enablement selector matches"
)

// Decision is the outcome for one pod.
type Decision struct {
	Ambient bool
	Reason  Reason
	Options podopts.Options
}

// Decide tells whether pod belongs in the mesh. ns may be nil when the
// namespace is unknown; then only the pod label can enroll it.
func Decide(cfg Config, pod *corev1.Pod, ns *corev1.Namespace) Decision {
	if d, excluded := excluded(cfg, pod); excluded {
		return d
	}
	if len(cfg.Selectors) > 0 {
		if matchesSelectors(cfg.Selectors, pod, ns) {
			return Decision{Ambient: true, Reason: ReasonSelected, Options: PodOptions(cfg, pod)}
		}
		return Decision{Reason: ReasonNotSelected}
	}
	mode := pod.Labels[DataplaneModeLabel]
	switch {
	case mode == DataplaneModeAmbient:
		return Decision{Ambient: true, Reason: ReasonPodLabel, Options: PodOptions(cfg, pod)}
	case mode == DataplaneModeNone:
		return Decision{Reason: ReasonOptedOut}
	case ns != nil && ns.Labels[DataplaneModeLabel] == DataplaneModeAmbient:
		return Decision{Ambient: true, Reason: ReasonNamespaceLabel, Options: PodOptions(cfg, pod)}
	}
	return Decision{Reason: ReasonNotLabelled}
}

// Excluded reports whether the pod can never be enrolled, whatever the
// labels say; the CNI plugin uses it to let such pods through when the
// agent is down.
func Excluded(cfg Config, pod *corev1.Pod) (Reason, bool) {
	d, ex := excluded(cfg, pod)
	return d.Reason, ex
}

func excluded(cfg Config, pod *corev1.Pod) (Decision, bool) {
	switch {
	case pod.Spec.HostNetwork:
		return Decision{Reason: ReasonHostNetwork}, true
	case pod.Annotations[SidecarStatusAnnotation] != "":
		return Decision{Reason: ReasonSidecar}, true
	case slices.Contains(cfg.ExcludedNamespaces, pod.Namespace):
		return Decision{Reason: ReasonExcludedNS}, true
	case matches(cfg.SelfLabels, pod.Labels):
		return Decision{Reason: ReasonSelf}, true
	case matches(cfg.ZtunnelLabels, pod.Labels) && (cfg.ZtunnelNamespace == "" || pod.Namespace == cfg.ZtunnelNamespace):
		return Decision{Reason: ReasonZtunnel}, true
	case pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return Decision{Reason: ReasonTerminal}, true
	}
	return Decision{}, false
}

// PodOptions reads the per-pod annotations.
func PodOptions(cfg Config, pod *corev1.Pod) podopts.Options {
	o := podopts.Options{DNSCapture: cfg.DNSCapture}
	o.BypassInbound = pod.Annotations[BypassInboundAnnotation] == "true"
	switch pod.Annotations[DNSCaptureAnnotation] {
	case "true":
		o.DNSCapture = true
	case "false":
		o.DNSCapture = false
	}
	if v := pod.Annotations[RerouteInterfacesAnnotation]; v != "" {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				o.RerouteInterfaces = append(o.RerouteInterfaces, name)
			}
		}
	}
	return o
}

func matches(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}
