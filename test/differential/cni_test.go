//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// cniExit is what the runtime learns of a CNI call: exit 0, or the
// plugin's error code (libcni's *types.Error). The messages are left out:
// each plugin names itself in them.
func cniExit(err error) string {
	if err == nil {
		return "ok"
	}
	if te := (*types.Error)(nil); errors.As(err, &te) {
		return fmt.Sprintf("error code %d", te.Code)
	}
	return "error (no CNI code)"
}

// The CNI calls a runtime makes, with the agent up and with it down as in
// a rolling update of its DaemonSet (its plugin still chained, no agent
// to answer): CHECK of an enrolled pod and STATUS (CNI 1.1); then, down,
// STATUS, ADD of an ambient pod
// (it must fail: fail closed), ADD of a pod not in the mesh (it must
// pass: the plugin reads the pod from the API server itself), CHECK and
// DEL of the enrolled pod. Which calls pass and which fail is the same on
// both; the failing ADD's CNI error code differs as docs/CONTRACT.md
// lists (istio-cni's generic 999, ambient-ebpf's 11, "try again later").
func TestCNICallsWithTheAgentUpAndDownBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string][]string{}
	eachSide(t, c, func(s *side, nodeName string) {
		p, _ := addEnabledPod(t, c, s, nodeName)
		netns := filepath.Join(s.runtime.NetnsDir, p.NS)
		var lines []string
		lines = append(lines, "CHECK of the enrolled pod, agent up: "+cniExit(s.runtime.Check(p, netns)))
		lines = append(lines, "STATUS, agent up: "+cniExit(s.runtime.Status()))
		if err := s.stop(); err != nil {
			t.Fatalf("%s: stop the agent: %v", s.name, err)
		}
		ambient, _, _ := addPodAs(t, c, s, nodeName, podCase{name: "ambient-while-down",
			nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}, 0)
		lines = append(lines, "ADD of an ambient pod, agent down: "+ambient.AddExit)
		plain, _, _ := addPodAs(t, c, s, nodeName, podCase{name: "plain-while-down"}, 0)
		lines = append(lines, "ADD of a pod not in the mesh, agent down: "+plain.AddExit)
		lines = append(lines, "CHECK of the enrolled pod, agent down: "+cniExit(s.runtime.Check(p, netns)))
		lines = append(lines, "STATUS, agent down: "+cniExit(s.runtime.Status()))
		lines = append(lines, "DEL of the enrolled pod, agent down: "+cniExit(s.runtime.Del(p, netns)))
		t.Logf("%s:\n  %s\n  ADD errors: %q, %q", s.name, strings.Join(lines, "\n  "), ambient.AddErr, plain.AddErr)
		got[s.name] = lines
		if err := s.start(); err != nil {
			t.Fatalf("%s: start the agent again: %v", s.name, err)
		}
	})
	const failedAdd = "ADD of an ambient pod, agent down: "
	if istio, ours := got["istio-cni"], got["ambient-ebpf"]; len(istio) == len(ours) {
		for i := range istio {
			if istio[i] == failedAdd+"error code 999" && ours[i] == failedAdd+"error code 11" {
				istio[i], ours[i] = failedAdd+"fails (the codes listed in docs/CONTRACT.md)", failedAdd+"fails (the codes listed in docs/CONTRACT.md)"
			}
		}
	}
	if istio, ours := got["istio-cni"], got["ambient-ebpf"]; !slices.Equal(istio, ours) {
		t.Errorf("the runtime saw different exits:\nistio-cni:\n  %s\nambient-ebpf:\n  %s", strings.Join(istio, "\n  "), strings.Join(ours, "\n  "))
	}
}
