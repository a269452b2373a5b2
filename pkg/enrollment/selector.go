// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"encoding/json"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// Selector is one of istio-cni's ambient enablement selectors
// (ambient.enablementSelectors): a pod matches when its labels match
// PodSelector and its namespace's labels match NamespaceSelector. An empty
// selector matches everything.
type Selector struct {
	PodSelector       metav1.LabelSelector `json:"podSelector"`
	NamespaceSelector metav1.LabelSelector `json:"namespaceSelector"`
}

// DefaultSelectors are istio-cni's default enablement selectors: the pod
// labelled ambient, or its namespace labelled ambient and the pod not
// labelled none. Decide without Selectors decides the same.
func DefaultSelectors() []Selector {
	mode := DataplaneModeLabel
	return []Selector{
		{PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{mode: DataplaneModeAmbient}}},
		{
			PodSelector: metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{
				{Key: mode, Operator: metav1.LabelSelectorOpNotIn, Values: []string{DataplaneModeNone}},
			}},
			NamespaceSelector: metav1.LabelSelector{MatchLabels: map[string]string{mode: DataplaneModeAmbient}},
		},
	}
}

// ParseSelectors reads a list of Selectors from YAML or JSON (the chart
// renders JSON), strictly: an unknown field or an invalid selector is an
// error naming the entry.
func ParseSelectors(data []byte) ([]Selector, error) {
	var out []Selector
	if err := yaml.UnmarshalStrict(data, &out); err != nil {
		return nil, fmt.Errorf("enablement selectors: %w", err)
	}
	if len(out) == 0 {
		return nil, errors.New("enablement selectors: empty list (no pod would be ambient)")
	}
	for i, s := range out {
		if _, _, err := s.compile(); err != nil {
			return nil, fmt.Errorf("enablement selector %d: %w", i, err)
		}
	}
	return out, nil
}

// SelectorsString is the selectors as the --enablement-selectors flag and
// the plugin's conflist entry take them.
func SelectorsString(s []Selector) string {
	b, _ := json.Marshal(s)
	return string(b)
}

func (s Selector) compile() (pod, ns labels.Selector, err error) {
	if pod, err = metav1.LabelSelectorAsSelector(&s.PodSelector); err != nil {
		return nil, nil, fmt.Errorf("podSelector: %w", err)
	}
	if ns, err = metav1.LabelSelectorAsSelector(&s.NamespaceSelector); err != nil {
		return nil, nil, fmt.Errorf("namespaceSelector: %w", err)
	}
	return pod, ns, nil
}

// matchesSelectors reports whether any selector matches the pod in ns (nil:
// a namespace without labels). Selectors that do not compile match nothing;
// ParseSelectors refuses them up front.
func matchesSelectors(sel []Selector, pod *corev1.Pod, ns *corev1.Namespace) bool {
	var nsLabels labels.Set
	if ns != nil {
		nsLabels = ns.Labels
	}
	for _, s := range sel {
		p, n, err := s.compile()
		if err == nil && p.Matches(labels.Set(pod.Labels)) && n.Matches(nsLabels) {
			return true
		}
	}
	return false
}
