//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
)

// enablementCases are pods whose enrolment the namespace's and the pod's
// labels and annotations decide.
var enablementCases = []podCase{
	{name: "ns-ambient", nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
	{name: "pod-ambient", labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
	{name: "opted-out", nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient},
		labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeNone}},
	{name: "sidecar", nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient},
		annotations: map[string]string{enrollment.SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`}},
	{name: "not-labelled"},
	// The excluded namespace (both charts' default).
	{name: "kube-system-ambient", namespace: "kube-system", labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
	// ztunnel's pod (app=ztunnel in the system namespace), labelled
	// ambient; and a pod labelled app=ztunnel elsewhere, an app like any
	// other to istio-cni (ambient-ebpf excluded it until this test).
	{name: "ztunnel", namespace: "istio-system", labels: map[string]string{"app": "ztunnel", enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
	{name: "app-ztunnel-elsewhere", nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient},
		labels: map[string]string{"app": "ztunnel"}},
	// A hostNetwork pod labelled ambient (either agent's own pod is one,
	// labelled dataplane-mode=none too): no ADD, the informers alone.
	{name: "host-network", hostNetwork: true, labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
}

// Pods labelled and annotated each way, added one after another to each
// side's node: the ADD's exit, the pod's annotation (given 2 s where it
// stays unset) and whether ztunnel was handed the pod are the same on
// both. (kubelet runs no CNI ADD for a hostNetwork pod: that one is
// created Running in the API server alone.)
func TestEnablementBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string][]string{}
	eachSide(t, c, func(s *side, nodeName string) {
		got[s.name] = enablementOf(t, c, s, nodeName, enablementCases)
	})
	istio, ours := got["istio-cni"], got["ambient-ebpf"]
	for i := 0; i < len(istio) && i < len(ours); i++ {
		for _, d := range enablementDifferences {
			if istio[i] == d.istio && ours[i] == d.ours {
				istio[i], ours[i] = "(the difference listed in docs/CONTRACT.md) "+istio[i], "(the difference listed in docs/CONTRACT.md) "+istio[i]
			}
		}
	}
	if !slices.Equal(istio, ours) {
		t.Errorf("enablement differs:\nistio-cni:\n  %s\nambient-ebpf:\n  %s", strings.Join(istio, "\n  "), strings.Join(ours, "\n  "))
	}
}

// enablementOf adds the pods one after another to the side's node and
// says, for each, the ADD's error, the annotation it got (given 2 s where
// it stays unset) and whether ztunnel was handed it.
func enablementOf(t *testing.T, c *kubeapi.Cluster, s *side, nodeName string, cases []podCase) []string {
	t.Helper()
	var lines []string
	for _, pc := range cases {
		o, p, _ := addPodAs(t, c, s, nodeName, pc, 2*time.Second)
		handed := slices.ContainsFunc(transcript(t, s, p), func(m string) bool { return strings.Contains(m, ": add uid=<pod uid> ") })
		line := fmt.Sprintf("%s: ADD error %q, annotation %q, handed to ztunnel %t", pc.name, o.AddErr, o.Annotation, handed)
		t.Logf("%s: %s", s.name, line)
		lines = append(lines, line)
	}
	return lines
}

// Enablement selectors in place of the label rule (istio-cni's chart
// value ambient.enablementSelectors, ambient-ebpf's
// --enablement-selectors, the same YAML): a pod selector on a label of
// the user's, and a namespace selector on another. The same pods are
// enrolled on both; the dataplane-mode label alone no longer enrols, and
// the exclusions still hold.
func TestEnablementSelectorsBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	const selectors = "- podSelector:\n    matchLabels: {mesh: enrolled}\n- namespaceSelector:\n    matchLabels: {team: meshed}\n"
	values := istiocnireal.AmbientProfile + "ambient:\n  enablementSelectors:\n" + indent(selectors, "  ")
	cases := []podCase{
		{name: "pod-selected", labels: map[string]string{"mesh": "enrolled"}},
		{name: "namespace-selected", nsLabels: map[string]string{"team": "meshed"}},
		{name: "dataplane-mode-label", labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
		{name: "selected-in-kube-system", namespace: "kube-system", labels: map[string]string{"mesh": "enrolled"}},
		{name: "selected-with-sidecar", labels: map[string]string{"mesh": "enrolled"},
			annotations: map[string]string{enrollment.SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`}},
		{name: "not-selected"},
	}
	got := map[string][]string{}
	for _, s := range []*side{
		istioCNISideWith(t, c, istiocnireal.Options{NodeName: "diff-" + testenv.RunID(), Values: values}),
		ambientEBPFSide(t, c, "diff-"+testenv.RunID(), "--enablement-selectors="+selectors),
	} {
		got[s.name] = enablementOf(t, c, s, s.nodeName, cases)
	}
	if istio, ours := got["istio-cni"], got["ambient-ebpf"]; !slices.Equal(istio, ours) {
		t.Errorf("enablement by selectors differs:\nistio-cni:\n  %s\nambient-ebpf:\n  %s", strings.Join(istio, "\n  "), strings.Join(ours, "\n  "))
	}
}

// indent prefixes every line of s.
func indent(s, prefix string) string {
	lines := strings.SplitAfter(s, "\n")
	for i, l := range lines {
		if l != "" {
			lines[i] = prefix + l
		}
	}
	return strings.Join(lines, "")
}

// podEvents lists the Kubernetes Events about the pod ("Type Reason by
// component"), in the order they were first seen; "none" when there are
// none. Neither agent posts any in a normal enrolment or removal (both
// post Events only when they repair or delete a broken pod).
func podEvents(t *testing.T, c *kubeapi.Cluster, kp *corev1.Pod) []string {
	t.Helper()
	evs, err := c.Client.CoreV1().Events(kp.Namespace).List(context.Background(), metav1.ListOptions{FieldSelector: "involvedObject.uid=" + string(kp.UID)})
	if err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(evs.Items, func(a, b corev1.Event) int { return a.FirstTimestamp.Compare(b.FirstTimestamp.Time) })
	var out []string
	for _, e := range evs.Items {
		out = append(out, e.Type+" "+e.Reason+" by "+e.Source.Component)
	}
	if len(out) == 0 {
		out = []string{"none"}
	}
	return out
}

// enablementDifferences are the lines of TestEnablementBothWays that
// differ as docs/CONTRACT.md lists: ztunnel's own pod labelled ambient is
// enrolled by istio-cni's plugin (it leaves ztunnel out of its informers'
// snapshot and namespace events only), never by ambient-ebpf (contract
// section 5: ztunnel redirected into itself).
var enablementDifferences = []struct{ istio, ours string }{{
	istio: `ztunnel: ADD error "", annotation "enabled", handed to ztunnel true`,
	ours:  `ztunnel: ADD error "", annotation "", handed to ztunnel false`,
}}

// A running pod's namespace labelled ambient, then the label taken away:
// each side enrols the pod from its informer (istio-cni finds its netns
// from the pod's pause process), then removes it; the annotation at each
// step, what ztunnel received and the pod's Events (none) are the same.
func TestLiveLabelChangesBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string][]string{}
	eachSide(t, c, func(s *side, nodeName string) {
		o, p, kp := addPodAs(t, c, s, nodeName, podCase{name: "live"}, 0)
		if o.AddErr != "" {
			t.Fatalf("%s: ADD error %q", s.name, o.AddErr)
		}
		s.node.StartPause(p, s.pidns)
		var steps []string
		for _, step := range []struct {
			label string // the namespace's dataplane-mode, "" for none
			want  enrollment.Redirection
		}{{enrollment.DataplaneModeAmbient, enrollment.RedirectionEnabled}, {"", enrollment.RedirectionNone}} {
			setNamespaceMode(t, c, kp.Namespace, step.label)
			ann := enrollment.Redirection(c.WaitAnnotation(t, kp, enrollment.RedirectionAnnotation, string(step.want), 30*time.Second))
			steps = append(steps, fmt.Sprintf("namespace mode %q: annotation %q", step.label, ann))
		}
		// The del may follow the annotation's removal.
		testenv.Poll(10*time.Second, func() bool {
			return slices.ContainsFunc(transcript(t, s, p), func(m string) bool { return strings.Contains(m, ": del uid=<pod uid> ") })
		})
		for _, m := range transcript(t, s, p) {
			if strings.Contains(m, "<pod uid>") {
				steps = append(steps, m)
			}
		}
		steps = append(steps, "events of the pod: "+strings.Join(podEvents(t, c, kp), ", "))
		t.Logf("%s:\n  %s", s.name, strings.Join(steps, "\n  "))
		got[s.name] = steps
	})
	if istio, ours := got["istio-cni"], got["ambient-ebpf"]; !slices.Equal(istio, ours) {
		t.Errorf("live label changes differ:\nistio-cni:\n  %s\nambient-ebpf:\n  %s", strings.Join(istio, "\n  "), strings.Join(ours, "\n  "))
	}
}

// setNamespaceMode sets the namespace's dataplane-mode label, or removes
// it for "".
func setNamespaceMode(t *testing.T, c *kubeapi.Cluster, namespace, mode string) {
	t.Helper()
	value := "null"
	if mode != "" {
		value = strconv.Quote(mode)
	}
	body := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, enrollment.DataplaneModeLabel, value)
	if _, err := c.Client.CoreV1().Namespaces().Patch(context.Background(), namespace, types.MergePatchType, []byte(body), metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", namespace, err)
	}
}
