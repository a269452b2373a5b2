//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
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
}

// Pods labelled and annotated each way, added one after another to each
// side's node: the ADD's exit, the pod's annotation (given 2 s where it
// stays unset) and whether ztunnel was handed the pod are the same on
// both. (kubelet runs no CNI ADD for a hostNetwork pod, so there is none
// here.)
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
	if istio, ours := got["istio-cni"], got["ambient-ebpf"]; !slices.Equal(istio, ours) {
		t.Errorf("enablement differs:\nistio-cni:\n  %s\nambient-ebpf:\n  %s", strings.Join(istio, "\n  "), strings.Join(ours, "\n  "))
	}
}
