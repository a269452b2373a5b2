// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// With repair off an unredirected pod is neither deleted nor labelled (and
// the reconciler, without RepairInPlace, does not enroll it).
func TestRepairOffLeavesUnredirectedPodsAlone(t *testing.T) {
	cfg, err := Config{NodeName: "n", Repair: RepairConfig{Mode: RepairOff}, Logger: slog.New(slog.DiscardHandler)}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	pod := testPod()
	pod.Status.Phase = corev1.PodRunning
	client := fake.NewClientset(pod.DeepCopy())
	s := newStatusWriter(cfg, client, &apiWriter{client: client})
	s.Observe(reconciler.Change{Pod: pod, UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Repair: reconciler.Unredirected})
	if err := s.write(context.Background(), pod.Namespace+"/"+pod.Name); err != nil {
		t.Fatal(err)
	}
	if n := len(client.Actions()); n != 0 {
		t.Errorf("repair with mode off made %d API calls: %v", n, client.Actions())
	}
}
