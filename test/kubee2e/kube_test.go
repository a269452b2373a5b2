// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube/kubetest"
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
	t.Parallel()
	c := requireCluster(t)
	node, other := newNode(), newNode()
	ns := c.Namespace(t, "snap", ambientLabels)
	annotated := func(v string) map[string]string { return map[string]string{enrollment.RedirectionAnnotation: v} }
	enabled := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "enabled", Node: node, Annotations: annotated("enabled")}, ip(1))
	pending := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "pending", Node: node, Annotations: annotated("pending")}, ip(2))
	plain := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "plain", Node: node}, ip(3))
	c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "elsewhere", Node: other, Annotations: annotated("enabled")}, ip(4))

	var snap []*corev1.Pod
	a := startAgent(t, node, func(m *kubetest.Mesh, pods []*corev1.Pod) {
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
	eventually(t, "the other pods of this node enrolled", func() bool { return enrolled(a, pending.UID) && enrolled(a, plain.UID) })
	if calls := a.mesh.CallsFor(enabled.UID); len(calls) != 0 {
		t.Errorf("adopted snapshot pod got mesh calls %+v; want none", calls)
	}
	never(t, "repair event on the adopted pod", func() bool { return hasEvent(t, enabled, kube.EventRepairedInPlace) })
	if got := annotation(t, enabled); got != "enabled" {
		t.Errorf("adopted pod annotation = %q; want enabled", got)
	}
}

func TestNamespaceLabelEnrollsAndRemovesRunningPods(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "nslabel", nil)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(10))
	a := startAgent(t, node, nil)

	never(t, "pod enrolled without any ambient label", func() bool { return enrolled(a, pod.UID) })
	patchNamespaceLabels(t, ns, map[string]any{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	eventually(t, "pod enrolled after the namespace label", func() bool { return enrolled(a, pod.UID) })
	eventually(t, "annotation enabled through status", func() bool { return annotation(t, pod) == "enabled" })

	patchNamespaceLabels(t, ns, map[string]any{enrollment.DataplaneModeLabel: nil})
	eventually(t, "pod removed after the namespace label is gone", func() bool { return !enrolled(a, pod.UID) })
	eventually(t, "annotation removed", func() bool { return !hasAnnotation(t, pod) })
	calls := a.mesh.CallsFor(pod.UID)
	if len(calls) != 2 || calls[0].Op != kubetest.OpAdd || calls[1].Op != kubetest.OpRemove {
		t.Errorf("mesh calls = %+v; want add then remove", calls)
	}
}

func TestPodLabelNoneOptsOutOfAmbientNamespace(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "optout", ambientLabels)
	none := map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeNone}
	out := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "out", Node: node, Labels: none}, ip(20))
	in := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "in", Node: node}, ip(21))
	a := startAgent(t, node, nil)

	eventually(t, "unlabelled pod of the ambient namespace enrolled", func() bool { return enrolled(a, in.UID) })
	never(t, "opted-out pod enrolled", func() bool { return enrolled(a, out.UID) })

	patchLabels(t, out, map[string]any{enrollment.DataplaneModeLabel: nil})
	eventually(t, "pod enrolled once its none label is gone", func() bool { return enrolled(a, out.UID) })
	patchLabels(t, out, map[string]any{enrollment.DataplaneModeLabel: enrollment.DataplaneModeNone})
	eventually(t, "pod removed when labelled none again", func() bool { return !enrolled(a, out.UID) })
	eventually(t, "annotation removed", func() bool { return !hasAnnotation(t, out) })
}

func TestSidecarAndHostNetworkPodsAreNeverEnrolled(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "never", ambientLabels)
	sidecar := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "sidecar", Node: node, Labels: ambientLabels,
		Annotations: map[string]string{enrollment.SidecarStatusAnnotation: `{"containers":["istio-proxy"]}`}}, ip(30))
	host := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "host", Node: node, Labels: ambientLabels, HostNetwork: true}, ip(31))
	barrier := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "barrier", Node: node}, ip(32))
	a := startAgent(t, node, nil)

	eventually(t, "barrier pod enrolled", func() bool { return enrolled(a, barrier.UID) })
	for _, p := range []*corev1.Pod{sidecar, host} {
		never(t, p.Name+" pod enrolled", func() bool { return len(a.mesh.CallsFor(p.UID)) > 0 })
		if hasAnnotation(t, p) {
			t.Errorf("%s pod got a redirection annotation", p.Name)
		}
	}
}

func TestPodsOfOtherNodesAreIgnored(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "othernode", ambientLabels)
	elsewhere := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "elsewhere", Node: newNode()}, ip(40))
	here := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "here", Node: node}, ip(41))
	a := startAgent(t, node, nil)

	eventually(t, "this node's pod enrolled", func() bool { return enrolled(a, here.UID) })
	never(t, "other node's pod touched", func() bool { return len(a.mesh.CallsFor(elsewhere.UID)) > 0 })
	if hasAnnotation(t, elsewhere) {
		t.Error("other node's pod got a redirection annotation")
	}
}

func TestAnnotationPendingUntilZtunnelAcks(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "pending", ambientLabels)
	a := startAgent(t, node, nil, func(_ *kube.Config, m *kubetest.Mesh) { m.SetPending(true) })
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(50))

	eventually(t, "annotation pending while ztunnel has not acked", func() bool { return annotation(t, pod) == "pending" })
	a.mesh.Ack(pod.UID)
	a.ctrl.Requeue(pod.Namespace, pod.Name)
	eventually(t, "annotation enabled after the ack", func() bool { return annotation(t, pod) == "enabled" })
}

func TestPodNotYetRunningIsLeftToTheCNIPlugin(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "cni", ambientLabels)
	a := startAgent(t, node, nil)
	pod := c.Pod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node})
	barrier := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "barrier", Node: node}, ip(60))

	eventually(t, "barrier pod enrolled", func() bool { return enrolled(a, barrier.UID) })
	never(t, "pending pod enrolled by the controller", func() bool { return len(a.mesh.CallsFor(pod.UID)) > 0 })
	// The CNI plugin enrolled it (the agent calls the Mesh directly); the
	// controller only publishes the result.
	a.mesh.Adopt(pod.UID)
	c.SetStatus(t, pod, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{ip(61)}})
	eventually(t, "annotation enabled for the CNI-enrolled pod", func() bool { return annotation(t, pod) == "enabled" })
	if calls := a.mesh.CallsFor(pod.UID); len(calls) != 0 {
		t.Errorf("mesh calls for a CNI-enrolled pod = %+v; want none", calls)
	}
}

func TestTerminalPodLeavesTheMesh(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "terminal", ambientLabels)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "job", Node: node}, ip(70))
	a := startAgent(t, node, nil)
	eventually(t, "pod enrolled", func() bool { return enrolled(a, pod.UID) })

	c.SetStatus(t, pod, kubeapi.Status{Phase: corev1.PodSucceeded, IPs: []netip.Addr{ip(70)}})
	eventually(t, "succeeded pod removed", func() bool { return !enrolled(a, pod.UID) })
	eventually(t, "annotation removed", func() bool { return !hasAnnotation(t, pod) })
}

func TestRecreatedPodWithSameNameAndIPIsANewPod(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "reuse", ambientLabels)
	spec := kubeapi.PodSpec{Namespace: ns.Name, Name: "db-0", Node: node}
	first := c.RunningPod(t, spec, ip(80))
	a := startAgent(t, node, nil)
	eventually(t, "first pod enrolled", func() bool { return enrolled(a, first.UID) })

	zero := int64(0)
	if err := c.Client.CoreV1().Pods(ns.Name).Delete(context.Background(), first.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "deleted pod removed by its UID", func() bool { return !enrolled(a, first.UID) })
	second := c.RunningPod(t, spec, ip(80))
	eventually(t, "recreated pod enrolled under its own UID", func() bool { return enrolled(a, second.UID) })
	eventually(t, "recreated pod annotated", func() bool { return annotation(t, second) == "enabled" })

	var ops []kubetest.Op
	for _, call := range a.mesh.CallsFor(first.UID) {
		ops = append(ops, call.Op)
	}
	if !slices.Equal(ops, []kubetest.Op{kubetest.OpAdd, kubetest.OpRemove}) {
		t.Errorf("calls for the first pod = %v; want add, remove", ops)
	}
}

func TestRepairInPlaceRedirectsPodStartedWhileAgentWasDown(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "repairinplace", ambientLabels)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(90))
	a := startAgent(t, node, nil)

	eventually(t, "pod redirected in place", func() bool { return enrolled(a, pod.UID) })
	eventually(t, "repair event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairedInPlace) })
	eventually(t, "annotation enabled", func() bool { return annotation(t, pod) == "enabled" })
}

func TestRepairDeleteRemovesUnredirectedPod(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "repairdelete", ambientLabels)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(100))
	a := startAgent(t, node, nil, withRepair(kube.RepairDelete))

	eventually(t, "unredirected pod deleted", func() bool { return deleting(t, pod) })
	eventually(t, "delete event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairDeleted) })
	if calls := a.mesh.CallsFor(pod.UID); len(calls) != 0 {
		t.Errorf("mesh calls = %+v; want none in delete mode", calls)
	}
}

func TestRepairLabelMarksUnredirectedPod(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "repairlabel", ambientLabels)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(110))
	a := startAgent(t, node, nil, withRepair(kube.RepairLabel))

	eventually(t, "unredirected pod labelled", func() bool {
		p, ok := getPod(t, pod)
		return ok && p.Labels[kube.DefaultRepairLabelKey] == kube.DefaultRepairLabelValue
	})
	eventually(t, "label event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairLabelled) })
	never(t, "labelled pod redirected", func() bool { return enrolled(a, pod.UID) })
}

func TestRepairNeverTouchesPodsWhoseContainersCompleted(t *testing.T) {
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "completed", ambientLabels)
	terminated := func(reason string, code int32) []corev1.ContainerStatus {
		return []corev1.ContainerStatus{{Name: "app", State: corev1.ContainerState{
			Terminated: &corev1.ContainerStateTerminated{Reason: reason, ExitCode: code},
		}}}
	}
	completed := c.SetStatus(t, c.Pod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "completed", Node: node}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{ip(120)}, Containers: terminated("Completed", 0)})
	exitZero := c.SetStatus(t, c.Pod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "exit-zero", Node: node}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{ip(121)}, Containers: terminated("Whatever", 0)})
	crashed := c.SetStatus(t, c.Pod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "crashed", Node: node}),
		kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{ip(122)}, Containers: terminated("Error", 1)})
	a := startAgent(t, node, nil, withRepair(kube.RepairDelete))

	eventually(t, "pod with a failed container deleted", func() bool { return deleting(t, crashed) })
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
	t.Parallel()
	c := requireCluster(t)
	node := newNode()
	ns := c.Namespace(t, "retry", ambientLabels)
	pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node}, ip(130))
	a := startAgent(t, node, nil, func(_ *kube.Config, m *kubetest.Mesh) { m.FailAdd(errors.New("netns not found")) })

	eventually(t, "failure event recorded", func() bool { return hasEvent(t, pod, kube.EventRepairFailed) })
	eventually(t, "add retried", func() bool { return len(a.mesh.CallsFor(pod.UID)) >= 2 })
	if hasAnnotation(t, pod) {
		t.Error("pod annotated although its redirect failed")
	}
	a.mesh.FailAdd(nil)
	eventually(t, "pod enrolled once the mesh recovers", func() bool { return enrolled(a, pod.UID) })
	eventually(t, "annotation enabled", func() bool { return annotation(t, pod) == "enabled" })
}
