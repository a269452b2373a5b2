// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubeapi

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
)

// Namespace creates a namespace with a unique name starting with prefix and
// the given labels. It is not deleted afterwards: without a namespace
// controller it would stay Terminating forever anyway.
func (c *Cluster) Namespace(tb testing.TB, prefix string, labels map[string]string) *corev1.Namespace {
	tb.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name:   strings.ToLower(prefix) + "-" + testenv.RunID(),
		Labels: labels,
	}}
	got, err := c.Client.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create namespace %s: %v", ns.Name, err)
	}
	return got
}

// PodSpec describes a test pod; zero values give a plain one-container pod.
type PodSpec struct {
	Namespace, Name, Node string
	Labels, Annotations   map[string]string
	HostNetwork           bool
}

// Pod creates a pod bound to spec.Node (no scheduler runs).
func (c *Cluster) Pod(tb testing.TB, spec PodSpec) *corev1.Pod {
	tb.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: spec.Name, Namespace: spec.Namespace,
			Labels: spec.Labels, Annotations: spec.Annotations,
		},
		Spec: corev1.PodSpec{
			NodeName:    spec.Node,
			HostNetwork: spec.HostNetwork,
			Containers:  []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}},
		},
	}
	got, err := c.Client.CoreV1().Pods(spec.Namespace).Create(context.Background(), p, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("create pod %s/%s: %v", spec.Namespace, spec.Name, err)
	}
	return got
}

// Status is the part of a pod's status a test sets in place of the kubelet.
type Status struct {
	Phase corev1.PodPhase
	// IPs are the pod IPs, the first one also being status.podIP.
	IPs []netip.Addr
	// Containers, when set, replaces the container statuses; by default
	// every container is reported running.
	Containers []corev1.ContainerStatus
}

// SetStatus writes the pod's status through the status subresource, as the
// kubelet would, and returns the updated pod.
func (c *Cluster) SetStatus(tb testing.TB, pod *corev1.Pod, st Status) *corev1.Pod {
	tb.Helper()
	var got *corev1.Pod
	// The agent under test may patch the pod in between: retry on conflict.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var err error
		got, err = c.setStatus(pod, st)
		return err
	})
	if err != nil {
		tb.Fatalf("update status of pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	return got
}

func (c *Cluster) setStatus(pod *corev1.Pod, st Status) (*corev1.Pod, error) {
	ctx := context.Background()
	cur, err := c.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	cur.Status.Phase = st.Phase
	cur.Status.HostIP = "192.0.2.1"
	cur.Status.HostIPs = []corev1.HostIP{{IP: "192.0.2.1"}}
	cur.Status.PodIPs = nil
	for _, ip := range st.IPs {
		cur.Status.PodIPs = append(cur.Status.PodIPs, corev1.PodIP{IP: ip.String()})
	}
	cur.Status.PodIP = ""
	if len(st.IPs) > 0 {
		cur.Status.PodIP = st.IPs[0].String()
	}
	cur.Status.ContainerStatuses = st.Containers
	if st.Containers == nil && st.Phase == corev1.PodRunning {
		now := metav1.Now()
		for _, ctr := range cur.Spec.Containers {
			cur.Status.ContainerStatuses = append(cur.Status.ContainerStatuses, corev1.ContainerStatus{
				Name: ctr.Name, Image: ctr.Image, Ready: true,
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
			})
		}
	}
	return c.Client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
}

// RunningPod creates a pod and marks it Running with the given IPs.
func (c *Cluster) RunningPod(tb testing.TB, spec PodSpec, ips ...netip.Addr) *corev1.Pod {
	tb.Helper()
	return c.SetStatus(tb, c.Pod(tb, spec), Status{Phase: corev1.PodRunning, IPs: ips})
}

// String names the cluster's endpoint for logs.
func (c *Cluster) String() string {
	return fmt.Sprintf("kube-apiserver %s (logs in %s)", c.Config.Host, c.dir)
}
