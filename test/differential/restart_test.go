//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// afterRestart is what a side's users and ztunnel saw of an enrolled pod
// across a restart.
type afterRestart struct {
	// Session is what ztunnel received on the connection after the
	// restart, up to its snapshot_sent.
	Session    []string
	Annotation enrollment.Redirection
}

// restartedSession waits up to 30 s for the stand-in's second session to
// end its snapshot and returns what it received in it.
func restartedSession(t *testing.T, s *side, pod func() []string) []string {
	t.Helper()
	var got []string
	testenv.Poll(30*time.Second, func() bool {
		got = got[:0]
		for _, m := range pod() {
			if strings.HasPrefix(m, "session 2: ") {
				got = append(got, m)
			}
		}
		return slices.ContainsFunc(got, func(m string) bool { return strings.Contains(m, ": snapshot_sent ") })
	})
	return got
}

// bothWaysAcross adds one ambient pod on each side, with a pause process in
// the PID namespace the side's agent sees (as kubelet's pods are), runs
// disrupt, and compares what ztunnel received in its next session and the
// pod's annotation afterwards.
func bothWaysAcross(t *testing.T, what string, disrupt func(*side) error) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string]afterRestart{}
	eachSide(t, c, func(s *side, nodeName string) {
		p, kp := addEnabledPod(t, c, s, nodeName)
		s.node.StartPause(p, s.pidns)
		if err := disrupt(s); err != nil {
			t.Fatalf("%s: %s: %v", s.name, what, err)
		}
		var r afterRestart
		r.Session = restartedSession(t, s, func() []string { return transcript(t, s, p) })
		cur, err := c.Client.CoreV1().Pods(kp.Namespace).Get(context.Background(), kp.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		r.Annotation = enrollment.Redirection(cur.Annotations[enrollment.RedirectionAnnotation])
		t.Logf("%s after %s:\n  annotation %q\n  ztunnel received:\n    %s", s.name, what, r.Annotation, strings.Join(r.Session, "\n    "))
		got[s.name] = r
	})
	istio, ours := got["istio-cni"], got["ambient-ebpf"]
	if istio.Annotation != ours.Annotation {
		t.Errorf("after %s: annotation istio-cni %q, ambient-ebpf %q", what, istio.Annotation, ours.Annotation)
	}
	if len(istio.Session) == 0 || !slices.Equal(istio.Session, ours.Session) {
		t.Errorf("after %s, ztunnel received different messages:\nistio-cni:\n  %s\nambient-ebpf:\n  %s",
			what, strings.Join(istio.Session, "\n  "), strings.Join(ours.Session, "\n  "))
	}
}

// The agent restarted as a rolling update restarts it, one pod enrolled:
// ztunnel's next session brings the pod with its netns (found again from
// the pod's processes by istio-cni, from the pins by ambient-ebpf), then
// the snapshot's end, and the pod stays annotated enabled on both.
func TestAgentRestartBothWays(t *testing.T) {
	bothWaysAcross(t, "the agent's restart", func(s *side) error { return s.restart() })
}

// ztunnel's connection drops and ztunnel connects again (its restart, as
// far as the agent can tell): the same next session on both.
func TestZtunnelReconnectBothWays(t *testing.T) {
	bothWaysAcross(t, "ztunnel's reconnect", func(s *side) error { return s.zt.DropZDS() })
}
