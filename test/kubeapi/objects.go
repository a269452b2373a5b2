// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubeapi

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
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

// WaitAnnotation waits up to timeout for the pod's annotation key to be
// want, and returns its last value (empty when absent).
func (c *Cluster) WaitAnnotation(tb testing.TB, pod *corev1.Pod, key, want string, timeout time.Duration) string {
	tb.Helper()
	var got string
	testenv.Poll(timeout, func() bool {
		cur, err := c.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
		if err != nil {
			tb.Fatalf("get pod %s/%s: %v", pod.Namespace, pod.Name, err)
		}
		got = cur.Annotations[key]
		return got == want
	})
	return got
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

// Apply creates a chart's object in namespace (the release's; cluster
// objects have none), or leaves it when it exists (a ClusterRole is
// replaced, so the rules are the chart's).
func (c *Cluster) Apply(tb testing.TB, namespace string, obj k8sruntime.Object) {
	tb.Helper()
	ctx := context.Background()
	cs := c.Client
	var err error
	switch o := obj.(type) {
	case *corev1.ServiceAccount:
		_, err = cs.CoreV1().ServiceAccounts(namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.ClusterRole:
		_, err = cs.RbacV1().ClusterRoles().Create(ctx, o, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			_, err = cs.RbacV1().ClusterRoles().Update(ctx, o, metav1.UpdateOptions{})
		}
	case *rbacv1.ClusterRoleBinding:
		_, err = cs.RbacV1().ClusterRoleBindings().Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.Role:
		_, err = cs.RbacV1().Roles(namespace).Create(ctx, o, metav1.CreateOptions{})
	case *rbacv1.RoleBinding:
		_, err = cs.RbacV1().RoleBindings(namespace).Create(ctx, o, metav1.CreateOptions{})
	case *appsv1.DaemonSet:
		_, err = cs.AppsV1().DaemonSets(namespace).Create(ctx, o, metav1.CreateOptions{})
	default:
		tb.Fatalf("apply %T: not handled", obj)
	}
	if err != nil && !apierrors.IsAlreadyExists(err) {
		tb.Fatalf("apply %T: %v", obj, err)
	}
}

// ServiceAccountToken returns a token of the service account (an hour
// long), as kubelet projects one into a pod: RBAC then applies to its
// bearer as to the pod.
func (c *Cluster) ServiceAccountToken(tb testing.TB, namespace, name string) string {
	tb.Helper()
	expiry := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(context.Background(), name,
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	if err != nil {
		tb.Fatalf("token for service account %s/%s: %v", namespace, name, err)
	}
	return tr.Status.Token
}

// EnsureNamespace creates the namespace (a release's, shared by tests)
// unless it exists.
func (c *Cluster) EnsureNamespace(tb testing.TB, name string) {
	tb.Helper()
	_, err := c.Client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		tb.Fatalf("create namespace %s: %v", name, err)
	}
}

// DaemonSet creates a minimal DaemonSet namespace/name, as the agent's
// uninstall check finds it: while it exists, a stopping agent keeps the
// node's state (a rolling update).
func (c *Cluster) DaemonSet(tb testing.TB, namespace, name string) {
	tb.Helper()
	c.DaemonSetOn(tb, namespace, name, nil)
}

// DaemonSetOn is DaemonSet with a nodeSelector: a node whose labels it
// no longer matches is one the DaemonSet leaves (an uninstall there).
func (c *Cluster) DaemonSetOn(tb testing.TB, namespace, name string, nodeSelector map[string]string) {
	tb.Helper()
	labels := map[string]string{"app": name}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace},
		Spec: appsv1.DaemonSetSpec{Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{NodeSelector: nodeSelector, Containers: []corev1.Container{{Name: "agent", Image: "registry.invalid/agent:1"}}}}}}
	if _, err := c.Client.AppsV1().DaemonSets(namespace).Create(context.Background(), ds, metav1.CreateOptions{}); err != nil {
		tb.Fatalf("create daemonset %s/%s: %v", namespace, name, err)
	}
}
