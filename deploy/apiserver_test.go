// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"bytes"
	"context"
	"errors"
	"flag"
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
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/yaml"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler/reconcilertest"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
)

// The chart's objects go to a real kube-apiserver (RBAC on, test/kubeapi)
// when its binaries are built; the render-only tests need none.
var (
	cluster    *kubeapi.Cluster
	clusterErr error
	api        *apiClients
)

func TestMain(m *testing.M) {
	flag.Parse()
	if testing.Short() {
		os.Exit(runShort(m))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cluster, clusterErr = kubeapi.Start(ctx)
	if clusterErr == nil {
		clusterErr = createNamespace(cluster.Client, releaseNS)
	}
	if clusterErr == nil {
		api, clusterErr = newAPIClients(ctx, cluster)
	}
	cancel()
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

// runShort runs the render-only tests: under -short (make test-unit) no
// API server starts, and the tests that need one skip.
func runShort(m *testing.M) int {
	clusterErr = kubeapi.ErrShort
	return m.Run()
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
	return kubeapi.Require(t, cluster, clusterErr)
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
			stale := map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)}
			pod := c.RunningPod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: "app", Node: node, Annotations: stale}, netip.MustParseAddr("10.244.0.10"))

			var logs syncBuffer
			log := slog.New(slog.NewTextHandler(&logs, nil))
			mesh := reconcilertest.NewMesh()
			rec := mesh.Start(t, reconciler.Config{Enrollment: cfg.Enrollment, Logger: log,
				RepairInPlace: cfg.Repair.Mode == "" || cfg.Repair.Mode == kube.RepairInPlace})
			kcfg := kube.Config{NodeName: node, Repair: cfg.Repair, Logger: log}
			ctrl, err := kube.New(kcfg, sa)
			if err != nil {
				t.Fatal(err)
			}
			w, err := kube.NewStatusWriter(kcfg, sa)
			if err != nil {
				t.Fatal(err)
			}
			rec.Subscribe(w.Observe)
			ctx, cancel := context.WithCancel(context.Background())
			if err := ctrl.Start(ctx); err != nil {
				cancel()
				t.Fatalf("informers with the chart's RBAC: %v", err)
			}
			done := make(chan error, 2)
			go func() { done <- w.Run(ctx) }()
			go func() { done <- ctrl.Run(ctx, mesh) }()
			defer func() {
				cancel()
				for range 2 {
					if err := <-done; err != nil {
						t.Errorf("controller: %v", err)
					}
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
					return get().Annotations[enrollment.RedirectionAnnotation] == string(enrollment.RedirectionEnabled) && len(mesh.Calls()) > 0
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
	if !testenv.Poll(30*time.Second, cond) {
		t.Fatalf("timed out waiting: %s; controller log:\n%s", what, logs.String())
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

// apiClients send rendered objects to the API server as they are.
type apiClients struct {
	dynamic dynamic.Interface
	mapper  meta.RESTMapper
}

// podMonitorCRD is the part of the Prometheus Operator's PodMonitor CRD the
// chart uses, with its types and patterns, so that a strict dry run checks
// our PodMonitor's fields (not the whole upstream schema).
const podMonitorCRD = `
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: podmonitors.monitoring.coreos.com}
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, listKind: PodMonitorList, plural: podmonitors, singular: podmonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            apiVersion: {type: string}
            kind: {type: string}
            metadata: {type: object}
            spec:
              type: object
              required: [selector]
              properties:
                selector:
                  type: object
                  properties:
                    matchLabels: {type: object, additionalProperties: {type: string}}
                    matchExpressions:
                      type: array
                      items:
                        type: object
                        required: [key, operator]
                        properties:
                          key: {type: string}
                          operator: {type: string}
                          values: {type: array, items: {type: string}}
                namespaceSelector:
                  type: object
                  properties:
                    any: {type: boolean}
                    matchNames: {type: array, items: {type: string}}
                podMetricsEndpoints:
                  type: array
                  items:
                    type: object
                    properties:
                      port: {type: string}
                      path: {type: string}
                      interval: {type: string, pattern: '^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$'}
`

func newAPIClients(ctx context.Context, c *kubeapi.Cluster) (*apiClients, error) {
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return nil, fmt.Errorf("dynamic client: %w", err)
	}
	var crd unstructured.Unstructured
	if err := yaml.Unmarshal([]byte(podMonitorCRD), &crd.Object); err != nil {
		return nil, fmt.Errorf("PodMonitor CRD: %w", err)
	}
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	if _, err := crds.Create(ctx, &crd, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return nil, fmt.Errorf("create PodMonitor CRD: %w", err)
	}
	disc := memory.NewMemCacheClient(c.Client.Discovery())
	for {
		disc.Invalidate()
		if _, err := disc.ServerResourcesForGroupVersion("monitoring.coreos.com/v1"); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("PodMonitor CRD not served: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	return &apiClients{dynamic: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(disc)}, nil
}

// dryRun sends every rendered object to the API server as a server-side
// dry run with strict field validation: what `kubectl apply --dry-run=server
// --validate=strict` checks, admission included, and nothing is stored.
func dryRun(t *testing.T, r *rendered) {
	requireCluster(t)
	for _, doc := range r.docs {
		var u unstructured.Unstructured
		if err := yaml.Unmarshal(doc, &u.Object); err != nil {
			t.Fatal(err)
		}
		gvk := u.GroupVersionKind()
		m, err := api.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			t.Errorf("%s: %v", gvk, err)
			continue
		}
		var ri dynamic.ResourceInterface = api.dynamic.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			ri = api.dynamic.Resource(m.Resource).Namespace(u.GetNamespace())
		}
		_, err = ri.Create(context.Background(), &u, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldValidation: "Strict"})
		if err != nil {
			t.Errorf("%s %s: the API server refuses it: %v", gvk.Kind, u.GetName(), err)
		}
	}
}
