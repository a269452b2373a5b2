// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// Each repair outcome reaches OnRepair once: the reconciler's in-place
// repairs through their Change, deletes and labels done by the writer.
func TestRepairOutcomesAreReported(t *testing.T) {
	cases := []struct {
		name       string
		mode       RepairMode
		repair     reconciler.Repair
		labelled   bool
		podMissing bool
		want       [2]string
	}{
		{name: "in place", mode: RepairInPlace, repair: reconciler.RepairedInPlace, want: [2]string{"repair", "success"}},
		{name: "in place fails", mode: RepairInPlace, repair: reconciler.RepairFailed, want: [2]string{"repair", "fail"}},
		{name: "delete", mode: RepairDelete, repair: reconciler.Unredirected, want: [2]string{"delete", "success"}},
		{name: "delete a pod already gone", mode: RepairDelete, repair: reconciler.Unredirected, podMissing: true, want: [2]string{"delete", "skip"}},
		{name: "label", mode: RepairLabel, repair: reconciler.Unredirected, want: [2]string{"label", "success"}},
		{name: "label a labelled pod", mode: RepairLabel, repair: reconciler.Unredirected, labelled: true, want: [2]string{"label", "skip"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got [][2]string
			cfg, err := Config{NodeName: "n", Repair: RepairConfig{Mode: tc.mode}, Logger: slog.New(slog.DiscardHandler),
				OnRepair: func(mode, result string) { got = append(got, [2]string{mode, result}) }}.withDefaults()
			if err != nil {
				t.Fatal(err)
			}
			pod := testPod()
			pod.Status.Phase = corev1.PodRunning
			if tc.labelled {
				pod.Labels = map[string]string{DefaultRepairLabelKey: DefaultRepairLabelValue}
			}
			client := fake.NewClientset()
			if !tc.podMissing {
				client = fake.NewClientset(pod.DeepCopy())
			}
			w := &apiWriter{client: client, recorder: record.NewFakeRecorder(10)}
			s := newStatusWriter(cfg, client, w)
			c := reconciler.Change{Pod: pod, UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Repair: tc.repair}
			if tc.repair == reconciler.RepairFailed {
				c.Err = errors.New("netns not found")
			}
			s.Observe(c)
			if err := s.write(context.Background(), pod.Namespace+"/"+pod.Name); err != nil {
				t.Errorf("write: %v", err)
			}
			if len(got) != 1 || got[0] != tc.want {
				t.Errorf("OnRepair heard %v, want [%v]", got, tc.want)
			}
		})
	}
}
