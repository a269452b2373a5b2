// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

type countingMesh struct{ adds int }

func (m *countingMesh) AddPodToMesh(context.Context, *corev1.Pod, enrollment.Options) error {
	m.adds++
	return nil
}
func (m *countingMesh) RemovePodFromMesh(context.Context, *corev1.Pod) error { return nil }
func (m *countingMesh) Redirection(types.UID) Redirection                    { return RedirectionNone }

func TestRepairOffLeavesUnredirectedPodsAlone(t *testing.T) {
	cfg, err := Config{NodeName: "n", Repair: RepairConfig{Mode: RepairOff}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	m := &countingMesh{}
	r := &reconciler{cfg: cfg, mesh: m, log: slog.Default(), known: map[string]*corev1.Pod{}}
	pod := testPod()
	pod.Status.Phase = corev1.PodRunning
	if err := r.repair(context.Background(), pod, enrollment.Decision{Ambient: true}); err != nil || m.adds != 0 {
		t.Errorf("repair with mode off: err %v, %d adds", err, m.adds)
	}
}
