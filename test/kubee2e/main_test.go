// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package kubee2e runs pkg/kube's controller and status writer against a
// real kube-apiserver and etcd (test/kubeapi), with the reconciler over
// fakes of the data path and ztunnel (pkg/reconciler/reconcilertest). Each
// test has its own node name and namespaces, so the tests run in parallel
// against one API server.
package kubee2e

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler/reconcilertest"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
)

var (
	cluster    *kubeapi.Cluster
	clusterErr error
)

func TestMain(m *testing.M) {
	simnode.RunHelper() // the agent tests' helper processes
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	start := time.Now()
	cluster, clusterErr = kubeapi.Start(ctx)
	cancel()
	if clusterErr == nil {
		fmt.Fprintf(os.Stderr, "kubee2e: %s ready in %s\n", cluster, time.Since(start).Round(time.Millisecond))
	}
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

// requireCluster returns the API server, or skips (fails under CI=true)
// when the binaries are not built, and fails when they are but did not
// start.
func requireCluster(t *testing.T) *kubeapi.Cluster {
	t.Helper()
	return kubeapi.Require(t, cluster, clusterErr)
}

// scene is one test's node and namespace on the shared API server.
type scene struct {
	*kubeapi.Cluster
	node   string
	ns     *corev1.Namespace
	lastIP int
}

// newScene marks the test parallel and gives it a fresh node name and a
// namespace (name prefix, labels) of its own.
func newScene(t *testing.T, prefix string, nsLabels map[string]string) *scene {
	t.Helper()
	t.Parallel()
	c := requireCluster(t)
	return &scene{Cluster: c, node: newNode(), ns: c.Namespace(t, prefix, nsLabels)}
}

// ip returns the next pod address of the scene.
func (s *scene) ip() netip.Addr {
	s.lastIP++
	return netip.AddrFrom4([4]byte{10, 244, byte(s.lastIP >> 8), byte(s.lastIP)})
}

// pod creates a pod in the scene's namespace, on the scene's node unless
// spec names another.
func (s *scene) pod(t *testing.T, spec kubeapi.PodSpec) *corev1.Pod {
	t.Helper()
	spec.Namespace = s.ns.Name
	if spec.Node == "" {
		spec.Node = s.node
	}
	return s.Pod(t, spec)
}

// running creates a pod as pod does and marks it Running with a fresh IP.
func (s *scene) running(t *testing.T, spec kubeapi.PodSpec) *corev1.Pod {
	t.Helper()
	return s.SetStatus(t, s.pod(t, spec), kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{s.ip()}})
}

// agent is one controller, reconciler and status writer for one node, as
// the node agent runs them.
type agent struct {
	mesh *reconcilertest.Mesh
	rec  *reconciler.Reconciler
	ctrl *kube.Controller
}

type agentOption func(*kube.Config, *reconcilertest.Mesh)

func withRepair(mode kube.RepairMode) agentOption {
	return func(c *kube.Config, _ *reconcilertest.Mesh) { c.Repair.Mode = mode }
}

// cniAdd enrolls pod as the CNI plugin's ADD does, through the reconciler.
func (a *agent) cniAdd(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	p, ns, err := a.ctrl.Lookup(context.Background(), pod.Namespace, pod.Name)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.rec.CNIAdd(context.Background(), reconciler.CNIAdd{Pod: p, Namespace: ns, UID: string(pod.UID),
		Netns: "/proc/1/ns/net", Interface: "eth0"}); err != nil {
		t.Fatal(err)
	}
}

func newNode() string { return "node-" + testenv.RunID() }

// agent runs a controller for the scene's node in the contract's order:
// caches synced, snapshot (adopt is called with it, then the reconciler
// adopts it), then the status writer, the reconciler and the handlers. It
// stops when the test ends.
func (s *scene) agent(t *testing.T, adopt func(*reconcilertest.Mesh, []*corev1.Pod), opts ...agentOption) *agent {
	t.Helper()
	a := &agent{mesh: reconcilertest.NewMesh()}
	cfg := kube.Config{
		NodeName: s.node,
		Logger:   slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	for _, o := range opts {
		o(&cfg, a.mesh)
	}
	a.rec = a.mesh.Start(t, reconciler.Config{Enrollment: enrollment.DefaultConfig(), Logger: cfg.Logger,
		RepairInPlace: cfg.Repair.Mode == "" || cfg.Repair.Mode == kube.RepairInPlace})
	var err error
	if a.ctrl, err = kube.New(cfg, s.Client); err != nil {
		t.Fatal(err)
	}
	w, err := kube.NewStatusWriter(cfg, s.Client)
	if err != nil {
		t.Fatal(err)
	}
	a.rec.Subscribe(w.Observe)
	ctx, cancel := context.WithCancel(context.Background())
	if err := a.ctrl.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	snap, err := a.ctrl.Snapshot()
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if adopt != nil {
		adopt(a.mesh, snap)
	}
	a.rec.Adopt(ctx, snap)
	done := make(chan error, 2)
	go func() { done <- w.Run(ctx) }()
	go func() { done <- a.ctrl.Run(ctx, a.mesh) }()
	t.Cleanup(func() {
		cancel()
		for range 2 {
			if err := <-done; err != nil {
				t.Errorf("controller run: %v", err)
			}
		}
	})
	return a
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p[:len(p)-1]))
	return len(p), nil
}

// never checks that cond stays false for a while, after a barrier proved
// that the controller has already reconciled what cond is about.
func never(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if cond() {
			t.Fatalf("unexpected: %s", what)
		}
	}
}

func getPod(t *testing.T, pod *corev1.Pod) (*corev1.Pod, bool) {
	t.Helper()
	p, err := cluster.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil {
		return nil, false
	}
	return p, true
}

// annotation returns the pod's redirection annotation in the API server.
func annotation(t *testing.T, pod *corev1.Pod) string {
	t.Helper()
	p, ok := getPod(t, pod)
	if !ok {
		return "<gone>"
	}
	return p.Annotations[enrollment.RedirectionAnnotation]
}

func hasAnnotation(t *testing.T, pod *corev1.Pod) bool {
	t.Helper()
	p, ok := getPod(t, pod)
	if !ok {
		return false
	}
	_, has := p.Annotations[enrollment.RedirectionAnnotation]
	return has
}

// eventReasons returns the reasons of the Events recorded on the pod.
func eventReasons(t *testing.T, pod *corev1.Pod) []string {
	t.Helper()
	list, err := cluster.Client.CoreV1().Events(pod.Namespace).List(context.Background(), metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.uid", string(pod.UID)).String(),
	})
	if err != nil {
		t.Fatalf("list events of pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
	var out []string
	for _, e := range list.Items {
		out = append(out, e.Reason)
	}
	return out
}

func hasEvent(t *testing.T, pod *corev1.Pod, reason string) bool {
	for _, r := range eventReasons(t, pod) {
		if r == reason {
			return true
		}
	}
	return false
}

func enrolled(a *agent, uid types.UID) bool {
	return a.mesh.Redirection(uid) != enrollment.RedirectionNone
}

var ambientLabels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}

func patchLabels(t *testing.T, pod *corev1.Pod, labels map[string]any) {
	t.Helper()
	body := mustJSON(t, map[string]any{"metadata": map[string]any{"labels": labels}})
	if _, err := cluster.Client.CoreV1().Pods(pod.Namespace).Patch(context.Background(), pod.Name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		t.Fatalf("label pod %s/%s: %v", pod.Namespace, pod.Name, err)
	}
}

func patchNamespaceLabels(t *testing.T, ns *corev1.Namespace, labels map[string]any) {
	t.Helper()
	body := mustJSON(t, map[string]any{"metadata": map[string]any{"labels": labels}})
	if _, err := cluster.Client.CoreV1().Namespaces().Patch(context.Background(), ns.Name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		t.Fatalf("label namespace %s: %v", ns.Name, err)
	}
}
