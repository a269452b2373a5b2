// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/identity"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube/kubetest"
)

// hostilePods are pods no API server would store. The fake clientset does
// not validate, so they reach the informers as a broken or compromised API
// server would send them.
func hostilePods() []*corev1.Pod {
	return []*corev1.Pod{
		runningPod("shop", "../../links", "uid-1"),
		runningPod("shop", "web", "../../links"),
		runningPod("shop", "web2", ".."),
		runningPod("shop", "nul\x00", "uid-2"),
		runningPod("shop", "unicodé", "uid-3"),
		runningPod("shop", strings.Repeat("a", 254), "uid-4"),
		runningPod("shop", "web3", strings.Repeat("u", 40)),
		runningPod("shop", "web4", "a/b"),
		runningPod("shop", "web5", ""),
		runningPod("Shop", "web", "uid-5"),
	}
}

func runningPod(ns, name, uid string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns, Name: name, UID: types.UID(uid),
			Labels:      map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient},
			Annotations: map[string]string{enrollment.RedirectionAnnotation: enrollment.RedirectionEnabled},
		},
		Spec:   corev1.PodSpec{NodeName: "node-1"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.9"},
	}
}

// Informer objects with an invalid identity are skipped: never in the
// snapshot, never handed to the Mesh, an error for the CNI path's Lookup.
func TestControllerSkipsPodsWithInvalidIdentity(t *testing.T) {
	good := runningPod("shop", "good", "uid-good")
	good.Annotations = nil
	client := fake.NewClientset()
	for _, p := range append(hostilePods(), good) {
		if _, err := client.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mesh := kubetest.NewMesh()
	c, err := kube.New(testConfig(), client, mesh)
	if err != nil {
		t.Fatal(err)
	}
	stop := serve(t, c, func() {
		if snap, err := c.Snapshot(); err != nil || len(snap) != 0 {
			t.Errorf("snapshot = %d pods, %v; want none of the invalid ones", len(snap), err)
		}
	})
	waitFor(t, "the valid pod enrolled", func() bool { return mesh.Redirection("uid-good") == kube.RedirectionEnabled })
	stop()
	for _, call := range mesh.Calls() {
		if call.UID != "uid-good" {
			t.Errorf("mesh call for a pod with an invalid identity: %+v", call)
		}
	}
	for _, p := range hostilePods() {
		if _, _, err := c.Lookup(context.Background(), p.Namespace, p.Name); err == nil {
			t.Errorf("Lookup(%q, %q) found a pod with an invalid identity", p.Namespace, p.Name)
		}
	}
}

// A pod file entry without a uid is enrolled under the derived standalone
// uid, one path element; a file with the pod named shop/../../links, whose
// pins once went into links/, is refused as a whole.
func TestFileSourceGivesUIDlessPodsASafeStandaloneUID(t *testing.T) {
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: NAME, namespace: shop, labels: {istio.io/dataplane-mode: ambient}}\n" +
		"spec: {nodeName: node-1, containers: [{name: app, image: app}]}\nstatus: {phase: Running, podIP: 198.18.0.5}\n"
	_, mesh, _, stop := serveFile(t, strings.ReplaceAll(pod, "NAME", "web"))
	uid := types.UID(identity.StandaloneUID("shop", "web"))
	waitFor(t, "web enrolled under its standalone uid", func() bool { return mesh.Redirection(uid) == kube.RedirectionEnabled })
	stop()
	for _, call := range mesh.Calls() {
		if err := identity.PodUID(string(call.UID)); err != nil || call.UID != uid {
			t.Errorf("mesh call %+v: %v", call, err)
		}
	}

	bad := filepath.Join(t.TempDir(), "pods.yaml")
	if err := os.WriteFile(bad, []byte(strings.ReplaceAll(pod, "NAME", "../../links")), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := kube.NewFileSource(testConfig(), bad, kubetest.NewMesh())
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Start(context.Background()); !errors.Is(err, identity.ErrInvalid) || !strings.Contains(err.Error(), `"../../links"`) {
		t.Errorf("Start with a traversal pod name = %v; want an invalid identity naming it", err)
	}
}
