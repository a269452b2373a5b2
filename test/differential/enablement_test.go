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

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
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
		for _, pc := range enablementCases {
			o, p, _ := addPodAs(t, c, s, nodeName, pc, 2*time.Second)
			handed := slices.ContainsFunc(transcript(t, s, p), func(m string) bool { return strings.Contains(m, ": add uid=<pod uid> ") })
			line := fmt.Sprintf("%s: ADD error %q, annotation %q, handed to ztunnel %t", pc.name, o.AddErr, o.Annotation, handed)
			t.Logf("%s: %s", s.name, line)
			got[s.name] = append(got[s.name], line)
		}
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
// step and what ztunnel received are the same.
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
