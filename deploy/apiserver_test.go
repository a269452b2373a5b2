// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube/kubetest"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
)

// The chart's objects go to a real kube-apiserver (RBAC on, test/kubeapi)
// when its binaries are built; the render-only tests need none.
var (
	cluster    *kubeapi.Cluster
	clusterErr error
)

func TestMain(m *testing.M) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cluster, clusterErr = kubeapi.Start(ctx)
	cancel()
	if clusterErr == nil {
		clusterErr = createNamespace(cluster.Client, releaseNS)
	}
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

func createNamespace(c kubernetes.Interface, name string) error {
	_, err := c.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// requireCluster returns the API server, or skips (fails under CI=true)
// when its binaries are not built.
func requireCluster(t *testing.T) *kubeapi.Cluster {
	t.Helper()
	if errors.Is(clusterErr, kubeapi.ErrNoBinaries) {
		testenv.SkipOrFail(t, "%v", clusterErr)
	}
	if clusterErr != nil {
		t.Fatalf("start kube-apiserver: %v", clusterErr)
	}
	return cluster
}

// applyRBAC creates the rendered ServiceAccount and roles, and removes the
// cluster-scoped ones when the test ends.
func applyRBAC(t *testing.T, c kubernetes.Interface, r *rendered) {
	t.Helper()
	ctx := context.Background()
	var errs []error
	_, err := c.CoreV1().ServiceAccounts(releaseNS).Create(ctx, r.sa, metav1.CreateOptions{})
	errs = append(errs, err)
	_, err = c.RbacV1().ClusterRoles().Create(ctx, r.cr, metav1.CreateOptions{})
	errs = append(errs, err)
	_, err = c.RbacV1().ClusterRoleBindings().Create(ctx, r.crb, metav1.CreateOptions{})
	errs = append(errs, err)
	_, err = c.RbacV1().Roles(releaseNS).Create(ctx, r.role, metav1.CreateOptions{})
	errs = append(errs, err)
	_, err = c.RbacV1().RoleBindings(releaseNS).Create(ctx, r.rb, metav1.CreateOptions{})
	errs = append(errs, err)
	t.Cleanup(func() {
		_ = c.RbacV1().ClusterRoleBindings().Delete(ctx, r.crb.Name, metav1.DeleteOptions{})
		_ = c.RbacV1().ClusterRoles().Delete(ctx, r.cr.Name, metav1.DeleteOptions{})
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("apply the chart's RBAC: %v", err)
	}
}

// syncBuffer is a log sink the controller's workers share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The chart's RBAC, bound to its service account, is enough for what the
// agent's controller does in each repair mode: informers, the redirection
// annotation, the repair's delete or label, Events, and the upgrade check
// on its own DaemonSet; nothing comes back Forbidden.
func TestChartRBACIsEnoughForEachRepairMode(t *testing.T) {
	c := requireCluster(t)
	for _, mode := range []string{"repair", "delete", "label", "off"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			name := "ae-rbac-" + mode + "-" + testenv.RunID()
			r, err := renderChart(fmt.Sprintf("fullnameOverride: %s\nagent: {repairMode: %q}", name, mode))
			if err != nil {
				t.Fatal(err)
			}
			cfg := agentConfig(t, r)
			applyRBAC(t, c.Client, r)
			sa, err := kubernetes.NewForConfig(c.ServiceAccount(releaseNS, r.sa.Name))
			if err != nil {
				t.Fatal(err)
			}

			ns := c.Namespace(t, "rbac-"+mode, map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
			node := "node-" + testenv.RunID()
			stale := map[string]string{enrollment.RedirectionAnnotation: enrollment.RedirectionEnabled}
			pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node, Annotations: stale}, netip.MustParseAddr("10.244.0.10"))

			var logs syncBuffer
			mesh := kubetest.NewMesh()
			ctrl, err := kube.New(kube.Config{NodeName: node, Enrollment: cfg.Enrollment, Repair: cfg.Repair,
				Logger: slog.New(slog.NewTextHandler(&logs, nil))}, sa, mesh)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			if err := ctrl.Start(ctx); err != nil {
				cancel()
				t.Fatalf("informers with the chart's RBAC: %v", err)
			}
			done := make(chan error, 1)
			go func() { done <- ctrl.Run(ctx) }()
			defer func() {
				cancel()
				if err := <-done; err != nil {
					t.Errorf("controller: %v", err)
				}
				if strings.Contains(strings.ToLower(logs.String()), "forbidden") {
					t.Errorf("the controller met Forbidden:\n%s", logs.String())
				}
			}()

			get := func() *corev1.Pod {
				p, err := c.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
				if err != nil {
					return &corev1.Pod{}
				}
				return p
			}
			var what string
			var cond func() bool
			var reason string
			switch mode {
			case "repair":
				what, reason = "pod redirected in place and annotated", kube.EventRepairedInPlace
				cond = func() bool {
					return get().Annotations[enrollment.RedirectionAnnotation] == enrollment.RedirectionEnabled && len(mesh.Calls()) > 0
				}
			case "delete":
				what, reason = "unredirected pod deleted", kube.EventRepairDeleted
				cond = func() bool { p := get(); return p.Name == "" || p.DeletionTimestamp != nil }
			case "label":
				what, reason = "unredirected pod labelled, stale annotation gone", kube.EventRepairLabelled
				cond = func() bool {
					p := get()
					_, annotated := p.Annotations[enrollment.RedirectionAnnotation]
					return p.Labels[kube.DefaultRepairLabelKey] == kube.DefaultRepairLabelValue && !annotated
				}
			case "off":
				what = "stale annotation gone"
				cond = func() bool { _, annotated := get().Annotations[enrollment.RedirectionAnnotation]; return !annotated }
			}
			waitFor(t, what, &logs, cond)
			if reason != "" {
				waitFor(t, "event "+reason, &logs, func() bool { return hasEvent(c, pod, reason) })
			}

			// The upgrade check: its own DaemonSet only.
			if _, err := sa.AppsV1().DaemonSets(releaseNS).Get(context.Background(), r.ds.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Errorf("get own DaemonSet (not created): %v, want NotFound", err)
			}
			if _, err := sa.AppsV1().DaemonSets(releaseNS).Get(context.Background(), "other", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
				t.Errorf("get another DaemonSet: %v, want Forbidden", err)
			}
		})
	}
}

func waitFor(t *testing.T, what string, logs *syncBuffer, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting: %s; controller log:\n%s", what, logs.String())
		}
	}
}

func hasEvent(c *kubeapi.Cluster, pod *corev1.Pod, reason string) bool {
	list, err := c.Client.CoreV1().Events(pod.Namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.uid", string(pod.UID)).String(),
	})
	if err != nil {
		return false
	}
	for _, e := range list.Items {
		if e.Reason == reason {
			return true
		}
	}
	return false
}
