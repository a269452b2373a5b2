// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler/reconcilertest"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// deleting reports whether the pod is gone or being deleted: without a
// kubelet, a pod deleted with a grace period stays until it expires.
func deleting(t *testing.T, pod *corev1.Pod) bool {
	p, ok := getPod(t, pod)
	return !ok || p.DeletionTimestamp != nil
}

func TestSnapshotHoldsThisNodesPodsAnnotatedEnabled(t *testing.T) {
	s := newScene(t, "snap", ambientLabels)
	annotated := func(v string) map[string]string { return map[string]string{enrollment.RedirectionAnnotation: v} }
	enabled := s.running(t, kubeapi.PodSpec{Name: "enabled", Annotations: annotated("enabled")})
	pending := s.running(t, kubeapi.PodSpec{Name: "pending", Annotations: annotated("pending")})
	plain := s.running(t, kubeapi.PodSpec{Name: "plain"})
	s.running(t, kubeapi.PodSpec{Name: "elsewhere", Node: newNode(), Annotations: annotated("enabled")})

	var snap []*corev1.Pod
	a := s.agent(t, func(m *reconcilertest.Mesh, pods []*corev1.Pod) {
		snap = pods
		for _, p := range pods {
			m.Adopt(p.UID) // the pinned dataplane state survived
		}
	})
	if len(snap) != 1 || snap[0].UID != enabled.UID {
		var names []string
		for _, p := range snap {
			names = append(names, p.Name)
		}
		t.Fatalf("snapshot = %v; want only %s", names, enabled.Name)
	}
	// The adopted pod is not redirected again, nor counted as repaired.
	testenv.Eventually(t, 30*time.Second, "the other pods of this node enrolled", func() bool { return enrolled(a, pending.UID) && enrolled(a, plain.UID) })
	if calls := a.mesh.CallsFor(enabled.UID); len(calls) != 0 {
		t.Errorf("adopted snapshot pod got mesh calls %+v; want none", calls)
	}
	never(t, "repair event on the adopted pod", func() bool { return hasEvent(t, enabled, kube.EventRepairedInPlace) })
	if got := annotation(t, enabled); got != "enabled" {
		t.Errorf("adopted pod annotation = %q; want enabled", got)
	}
}

func TestNamespaceLabelEnrollsAndRemovesRunningPods(t *testing.T) {
	s := newScene(t, "nslabel", nil)
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})
	var nsEvents atomic.Int32
	a := s.agent(t, nil, func(c *kube.Config, _ *reconcilertest.Mesh) {
		c.OnEvent = func(object, typ string) {
			if object == "namespace" && typ == "update" {
				nsEvents.Add(1)
			}
		}
	})

	never(t, "pod enrolled without any ambient label", func() bool { return enrolled(a, pod.UID) })
	patchNamespaceLabels(t, s.ns, map[string]any{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	testenv.Eventually(t, 30*time.Second, "pod enrolled after the namespace label", func() bool { return enrolled(a, pod.UID) })
	testenv.Eventually(t, 30*time.Second, "annotation enabled through status", func() bool { return annotation(t, pod) == "enabled" })

	patchNamespaceLabels(t, s.ns, map[string]any{enrollment.DataplaneModeLabel: nil})
	testenv.Eventually(t, 30*time.Second, "pod removed after the namespace label is gone", func() bool { return !enrolled(a, pod.UID) })
	testenv.Eventually(t, 30*time.Second, "annotation removed", func() bool { return !hasAnnotation(t, pod) })
	if n := nsEvents.Load(); n != 2 {
		t.Errorf("namespace label events = %d; want 2", n)
	}
	calls := a.mesh.CallsFor(pod.UID)
	if len(calls) != 2 || calls[0].Op != reconcilertest.OpAdd || calls[1].Op != reconcilertest.OpRemove {
		t.Errorf("mesh calls = %+v; want add then remove", calls)
	}
}

func TestPodLabelNoneOptsOutOfAmbientNamespace(t *testing.T) {
	s := newScene(t, "optout", ambientLabels)
	none := map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeNone}
	out := s.running(t, kubeapi.PodSpec{Name: "out", Labels: none})
	in := s.running(t, kubeapi.PodSpec{Name: "in"})
	a := s.agent(t, nil)

	testenv.Eventually(t, 30*time.Second, "unlabelled pod of the ambient namespace enrolled", func() bool { return enrolled(a, in.UID) })
	never(t, "opted-out pod enrolled", func() bool { return enrolled(a, out.UID) })

	patchLabels(t, out, map[string]any{enrollment.DataplaneModeLabel: nil})
	testenv.Eventually(t, 30*time.Second, "pod enrolled once its none label is gone", func() bool { return enrolled(a, out.UID) })
	patchLabels(t, out, map[string]any{enrollment.DataplaneModeLabel: enrollment.DataplaneModeNone})
	testenv.Eventually(t, 30*time.Second, "pod removed when labelled none again", func() bool { return !enrolled(a, out.UID) })
	testenv.Eventually(t, 30*time.Second, "annotation removed", func() bool { return !hasAnnotation(t, out) })
}

func TestSidecarAndHostNetworkPodsAreNeverEnrolled(t *testing.T) {
	s := newScene(t, "never", ambientLabels)
	sidecar := s.running(t, kubeapi.PodSpec{Name: "sidecar", Labels: ambientLabels,
		Annotations: map[string]string{enrollment.SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`}})
	host := s.running(t, kubeapi.PodSpec{Name: "host", Labels: ambientLabels, HostNetwork: true})
	barrier := s.running(t, kubeapi.PodSpec{Name: "barrier"})
	a := s.agent(t, nil)

	testenv.Eventually(t, 30*time.Second, "barrier pod enrolled", func() bool { return enrolled(a, barrier.UID) })
	for _, p := range []*corev1.Pod{sidecar, host} {
		never(t, p.Name+" pod enrolled", func() bool { return len(a.mesh.CallsFor(p.UID)) > 0 })
		if hasAnnotation(t, p) {
			t.Errorf("%s pod got a redirection annotation", p.Name)
		}
	}
}

func TestPodsOfOtherNodesAreIgnored(t *testing.T) {
	s := newScene(t, "othernode", ambientLabels)
	elsewhere := s.running(t, kubeapi.PodSpec{Name: "elsewhere", Node: newNode()})
	here := s.running(t, kubeapi.PodSpec{Name: "here"})
	a := s.agent(t, nil)

	testenv.Eventually(t, 30*time.Second, "this node's pod enrolled", func() bool { return enrolled(a, here.UID) })
	never(t, "other node's pod touched", func() bool { return len(a.mesh.CallsFor(elsewhere.UID)) > 0 })
	if hasAnnotation(t, elsewhere) {
		t.Error("other node's pod got a redirection annotation")
	}
}

func TestAnnotationPendingUntilZtunnelAcks(t *testing.T) {
	s := newScene(t, "pending", ambientLabels)
	a := s.agent(t, nil, func(_ *kube.Config, m *reconcilertest.Mesh) { m.SetPending(true) })
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})

	testenv.Eventually(t, 30*time.Second, "annotation pending while ztunnel has not acked", func() bool { return annotation(t, pod) == "pending" })
	a.mesh.Ack(pod.UID)
	testenv.Eventually(t, 30*time.Second, "annotation enabled after the ack", func() bool { return annotation(t, pod) == "enabled" })
}

func TestPodNotYetRunningIsLeftToTheCNIPlugin(t *testing.T) {
	s := newScene(t, "cni", ambientLabels)
	a := s.agent(t, nil)
	pod := s.pod(t, kubeapi.PodSpec{Name: "app"})
	barrier := s.running(t, kubeapi.PodSpec{Name: "barrier"})

	testenv.Eventually(t, 30*time.Second, "barrier pod enrolled", func() bool { return enrolled(a, barrier.UID) })
	never(t, "pending pod enrolled by the controller", func() bool { return len(a.mesh.CallsFor(pod.UID)) > 0 })
	// The CNI plugin enrolled it (through the reconciler's CNI path); the
	// controller only reports the pod, the status writer publishes.
	a.cniAdd(t, pod)
	s.SetStatus(t, pod, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{s.ip()}})
	testenv.Eventually(t, 30*time.Second, "annotation enabled for the CNI-enrolled pod", func() bool { return annotation(t, pod) == "enabled" })
	if calls := a.mesh.CallsFor(pod.UID); len(calls) != 0 {
		t.Errorf("mesh calls for a CNI-enrolled pod = %+v; want none", calls)
	}
}

func TestTerminalPodLeavesTheMesh(t *testing.T) {
	s := newScene(t, "terminal", ambientLabels)
	pod := s.running(t, kubeapi.PodSpec{Name: "job"})
	a := s.agent(t, nil)
	testenv.Eventually(t, 30*time.Second, "pod enrolled", func() bool { return enrolled(a, pod.UID) })

	s.SetStatus(t, pod, kubeapi.Status{Phase: corev1.PodSucceeded, IPs: []netip.Addr{s.ip()}})
	testenv.Eventually(t, 30*time.Second, "succeeded pod removed", func() bool { return !enrolled(a, pod.UID) })
	testenv.Eventually(t, 30*time.Second, "annotation removed", func() bool { return !hasAnnotation(t, pod) })
}

func TestRecreatedPodWithSameNameAndIPIsANewPod(t *testing.T) {
	s := newScene(t, "reuse", ambientLabels)
	first := s.running(t, kubeapi.PodSpec{Name: "db-0"})
	a := s.agent(t, nil)
	testenv.Eventually(t, 30*time.Second, "first pod enrolled", func() bool { return enrolled(a, first.UID) })

	zero := int64(0)
	if err := s.Client.CoreV1().Pods(s.ns.Name).Delete(context.Background(), first.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "deleted pod removed by its UID", func() bool { return !enrolled(a, first.UID) })
	second := s.SetStatus(t, s.pod(t, kubeapi.PodSpec{Name: "db-0"}), kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{netip.MustParseAddr(first.Status.PodIP)}})
	testenv.Eventually(t, 30*time.Second, "recreated pod enrolled under its own UID", func() bool { return enrolled(a, second.UID) })
	testenv.Eventually(t, 30*time.Second, "recreated pod annotated", func() bool { return annotation(t, second) == "enabled" })

	var ops []reconcilertest.Op
	for _, call := range a.mesh.CallsFor(first.UID) {
		ops = append(ops, call.Op)
	}
	if !slices.Equal(ops, []reconcilertest.Op{reconcilertest.OpAdd, reconcilertest.OpRemove}) {
		t.Errorf("calls for the first pod = %v; want add, remove", ops)
	}
}

func TestRepairInPlaceRedirectsPodStartedWhileAgentWasDown(t *testing.T) {
	s := newScene(t, "repairinplace", ambientLabels)
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})
	a := s.agent(t, nil)

	testenv.Eventually(t, 30*time.Second, "pod redirected in place", func() bool { return enrolled(a, pod.UID) })
	testenv.Eventually(t, 30*time.Second, "repair event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairedInPlace) })
	testenv.Eventually(t, 30*time.Second, "annotation enabled", func() bool { return annotation(t, pod) == "enabled" })
}

func TestRepairDeleteRemovesUnredirectedPod(t *testing.T) {
	s := newScene(t, "repairdelete", ambientLabels)
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})
	a := s.agent(t, nil, withRepair(kube.RepairDelete))

	testenv.Eventually(t, 30*time.Second, "unredirected pod deleted", func() bool { return deleting(t, pod) })
	testenv.Eventually(t, 30*time.Second, "delete event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairDeleted) })
	if calls := a.mesh.CallsFor(pod.UID); len(calls) != 0 {
		t.Errorf("mesh calls = %+v; want none in delete mode", calls)
	}
}

func TestRepairLabelMarksUnredirectedPod(t *testing.T) {
	s := newScene(t, "repairlabel", ambientLabels)
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})
	a := s.agent(t, nil, withRepair(kube.RepairLabel))

	testenv.Eventually(t, 30*time.Second, "unredirected pod labelled", func() bool {
		p, ok := getPod(t, pod)
		return ok && p.Labels[kube.DefaultRepairLabelKey] == kube.DefaultRepairLabelValue
	})
	testenv.Eventually(t, 30*time.Second, "label event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairLabelled) })
	never(t, "labelled pod redirected", func() bool { return enrolled(a, pod.UID) })
}

func TestRepairNeverTouchesPodsWhoseContainersCompleted(t *testing.T) {
	s := newScene(t, "completed", ambientLabels)
	terminated := func(reason string, code int32) []corev1.ContainerStatus {
		return []corev1.ContainerStatus{{Name: "app", State: corev1.ContainerState{
			Terminated: &corev1.ContainerStateTerminated{Reason: reason, ExitCode: code},
		}}}
	}
	completed := s.SetStatus(t, s.pod(t, kubeapi.PodSpec{Name: "completed"}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{s.ip()}, Containers: terminated("Completed", 0)})
	exitZero := s.SetStatus(t, s.pod(t, kubeapi.PodSpec{Name: "exit-zero"}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{s.ip()}, Containers: terminated("Whatever", 0)})
	crashed := s.SetStatus(t, s.pod(t, kubeapi.PodSpec{Name: "crashed"}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{s.ip()}, Containers: terminated("Error", 1)})
	a := s.agent(t, nil, withRepair(kube.RepairDelete))

	testenv.Eventually(t, 30*time.Second, "pod with a failed container deleted", func() bool { return deleting(t, crashed) })
	for _, p := range []*corev1.Pod{completed, exitZero} {
		never(t, p.Name+" pod deleted", func() bool { return deleting(t, p) })
		if r := eventReasons(t, p); len(r) != 0 {
			t.Errorf("events on %s pod = %v; want none", p.Name, r)
		}
	}
	if calls := a.mesh.Calls(); len(calls) != 0 {
		t.Errorf("mesh calls = %+v; want none", calls)
	}
}

func TestFailedInPlaceRedirectIsRecordedAndRetried(t *testing.T) {
	s := newScene(t, "retry", ambientLabels)
	pod := s.running(t, kubeapi.PodSpec{Name: "app"})
	a := s.agent(t, nil, func(_ *kube.Config, m *reconcilertest.Mesh) { m.FailAdd(errors.New("netns not found")) })

	testenv.Eventually(t, 30*time.Second, "failure event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairFailed) })
	testenv.Eventually(t, 30*time.Second, "add retried", func() bool { return len(a.mesh.CallsFor(pod.UID)) >= 2 })
	if hasAnnotation(t, pod) {
		t.Error("pod annotated although its redirect failed")
	}
	a.mesh.FailAdd(nil)
	testenv.Eventually(t, 30*time.Second, "pod enrolled once the mesh recovers", func() bool { return enrolled(a, pod.UID) })
	testenv.Eventually(t, 30*time.Second, "annotation enabled", func() bool { return annotation(t, pod) == "enabled" })
}

// A pod annotated enabled that the agent does not hold (no pins survived,
// nothing redirects it) must not keep telling istiod it is captured: the
// annotation goes whether the pod is not running yet, is running with repair
// off, or is running and its in-place repair keeps failing.
func TestStaleEnabledAnnotationIsCleared(t *testing.T) {
	s := newScene(t, "stale", ambientLabels)
	enabled := map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)}
	notRunning := s.pod(t, kubeapi.PodSpec{Name: "not-running", Annotations: enabled})
	failing := s.running(t, kubeapi.PodSpec{Name: "failing", Annotations: enabled})
	barrier := s.running(t, kubeapi.PodSpec{Name: "barrier"})
	a := s.agent(t, nil, func(_ *kube.Config, m *reconcilertest.Mesh) { m.FailAdd(errors.New("netns not found")) })

	testenv.Eventually(t, 30*time.Second, "not-running pod's stale annotation cleared", func() bool { return !hasAnnotation(t, notRunning) })
	testenv.Eventually(t, 30*time.Second, "failing pod's stale annotation cleared", func() bool { return !hasAnnotation(t, failing) })
	testenv.Eventually(t, 30*time.Second, "failing pod's repair retried", func() bool { return len(a.mesh.CallsFor(failing.UID)) >= 2 })
	if calls := a.mesh.CallsFor(notRunning.UID); len(calls) != 0 {
		t.Errorf("mesh calls for the not-running pod = %+v; want none (the CNI plugin's)", calls)
	}
	a.mesh.FailAdd(nil)
	testenv.Eventually(t, 30*time.Second, "barrier pod enrolled once the mesh recovers", func() bool { return enrolled(a, barrier.UID) })
	testenv.Eventually(t, 30*time.Second, "failing pod annotated enabled once redirected", func() bool { return annotation(t, failing) == "enabled" })
}

func TestStaleEnabledAnnotationIsClearedWithRepairOff(t *testing.T) {
	s := newScene(t, "staleoff", ambientLabels)
	enabled := map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)}
	pod := s.running(t, kubeapi.PodSpec{Name: "app", Annotations: enabled})
	a := s.agent(t, nil, withRepair(kube.RepairOff))

	testenv.Eventually(t, 30*time.Second, "stale annotation cleared", func() bool { return !hasAnnotation(t, pod) })
	if calls := a.mesh.CallsFor(pod.UID); len(calls) != 0 {
		t.Errorf("mesh calls = %+v; want none with repair off", calls)
	}
}
