// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package enrollment

import (
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// istio-cni's chart default, as its values.yaml writes it.
const istioDefaultSelectors = `
- podSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
- podSelector:
    matchExpressions:
    - { key: istio.io/dataplane-mode, operator: NotIn, values: [none] }
  namespaceSelector:
    matchLabels: {istio.io/dataplane-mode: ambient}
`

// istio-cni's default selectors decide every pod as the contract's label
// rule does.
func TestDefaultSelectorsAreTheLabelRule(t *testing.T) {
	parsed, err := ParseSelectors([]byte(istioDefaultSelectors))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(parsed, DefaultSelectors()) {
		t.Errorf("istio-cni's default parses to %+v, want DefaultSelectors %+v", parsed, DefaultSelectors())
	}
	withSelectors := DefaultConfig()
	withSelectors.Selectors = parsed
	labelValues := []map[string]string{nil, {DataplaneModeLabel: DataplaneModeAmbient}, {DataplaneModeLabel: DataplaneModeNone}, {DataplaneModeLabel: "other"}}
	for _, podLabels := range labelValues {
		for _, nsLabels := range append(labelValues, map[string]string{"unknown namespace": ""}) {
			ns := namespace(nsLabels)
			if _, unknown := nsLabels["unknown namespace"]; unknown {
				ns = nil
			}
			p := pod("ns", podLabels, nil)
			if got, want := Decide(withSelectors, p, ns).Ambient, Decide(DefaultConfig(), p, ns).Ambient; got != want {
				t.Errorf("pod %v in namespace %v: selectors say %v, the label rule %v", podLabels, nsLabels, got, want)
			}
		}
	}
}

func TestSelectorsReplaceTheLabelRule(t *testing.T) {
	sel, err := ParseSelectors([]byte(`[{"podSelector": {"matchLabels": {"mesh": "yes"}}, "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]}}]`))
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Selectors = sel
	ambient := map[string]string{DataplaneModeLabel: DataplaneModeAmbient}
	runDecide(t, cfg, []decideCase{
		{"selected", pod("ns", map[string]string{"mesh": "yes"}, nil), namespace(map[string]string{"team": "a"}), true, ReasonSelected},
		{"namespace not selected", pod("ns", map[string]string{"mesh": "yes"}, nil), namespace(map[string]string{"team": "c"}), false, ReasonNotSelected},
		{"the ambient label alone no longer enrolls", pod("ns", ambient, nil), namespace(ambient), false, ReasonNotSelected},
		{"exclusions still hold", pod("kube-system", map[string]string{"mesh": "yes"}, nil), namespace(map[string]string{"team": "a"}), false, ReasonExcludedNS},
		{"host network still never", pod("ns", map[string]string{"mesh": "yes"}, nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
			namespace(map[string]string{"team": "a"}), false, ReasonHostNetwork},
	})
	if back, err := ParseSelectors([]byte(SelectorsString(sel))); err != nil || !reflect.DeepEqual(back, sel) {
		t.Errorf("SelectorsString does not parse back: %v, %v", back, err)
	}
}

func TestParseSelectorsRefusesWhatWouldNotWork(t *testing.T) {
	for name, in := range map[string]string{
		"empty list":       `[]`,
		"unknown field":    `[{"podSelectors": {}}]`,
		"unknown operator": `[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}]`,
		"not a list":       `{"podSelector": {}}`,
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := ParseSelectors([]byte(in)); err == nil || !strings.Contains(err.Error(), "enablement selector") {
				t.Errorf("ParseSelectors(%s) = %v", in, err)
			}
		})
	}
}
