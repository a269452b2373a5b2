// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler/reconcilertest"
)

var serve = reconcilertest.Serve

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
			Annotations: map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)},
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
	mesh := reconcilertest.NewMesh()
	mesh.Start(t, reconciler.Config{RepairInPlace: true, Logger: slog.New(slog.DiscardHandler)})
	c, err := kube.New(kube.Config{NodeName: "node-1", Logger: slog.New(slog.DiscardHandler)}, client)
	if err != nil {
		t.Fatal(err)
	}
	stop := serve(t, c, mesh, func() {
		if snap, err := c.Snapshot(); err != nil || len(snap) != 0 {
			t.Errorf("snapshot = %d pods, %v; want none of the invalid ones", len(snap), err)
		}
	})
	testenv.Eventually(t, 10*time.Second, "the valid pod enrolled", func() bool { return mesh.Redirection("uid-good") == enrollment.RedirectionEnabled })
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
