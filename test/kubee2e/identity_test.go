// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
)

// hostileNames are traversal, NUL, overlong and unicode names.
var hostileNames = []string{"..", "../../links", "a/b", "nul\x00", "unicodé", strings.Repeat("a", 254), "UPPER", "web "}

// Through the real API server, the informer entry point: the API server
// refuses pods and namespaces with the names pkg/validate refuses, so
// they never reach the informers, and every pod the controller hands the
// Mesh, and its server-assigned UID, passes pkg/validate. The controller's
// own check of informer objects is tested with a fake clientset that does
// not validate (pkg/kube).
func TestAPIServerRefusesInvalidIdentitiesAndTheControllerSeesValidOnes(t *testing.T) {
	s := newScene(t, "identity", ambientLabels)
	ctx := context.Background()
	for _, name := range hostileNames {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: s.ns.Name},
			Spec:       corev1.PodSpec{NodeName: s.node, Containers: []corev1.Container{{Name: "app", Image: "registry.invalid/app:1"}}},
		}
		if got, err := s.Client.CoreV1().Pods(s.ns.Name).Create(ctx, pod, metav1.CreateOptions{}); err == nil {
			t.Errorf("the API server created pod %q (as %q)", name, got.Name)
		}
		if got, err := s.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err == nil {
			t.Errorf("the API server created namespace %q (as %q)", name, got.Name)
		}
	}
	web := s.running(t, kubeapi.PodSpec{Name: "web"})
	dotted := s.running(t, kubeapi.PodSpec{Name: "web.v2"})
	a := s.agent(t, nil)
	testenv.Eventually(t, 30*time.Second, "the valid pods enrolled", func() bool { return enrolled(a, web.UID) && enrolled(a, dotted.UID) })
	for _, c := range a.mesh.Calls() {
		ns, name, _ := strings.Cut(c.Pod, "/")
		if err := validate.Pod(ns, name, string(c.UID)); err != nil {
			t.Errorf("mesh call %+v: %v", c, err)
		}
	}
	for _, name := range hostileNames {
		if _, _, err := a.ctrl.Lookup(ctx, s.ns.Name, name); err == nil {
			t.Errorf("Lookup found a pod named %q", name)
		}
	}
}
