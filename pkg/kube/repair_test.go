// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

type failingMesh struct{ nopMesh }

func (failingMesh) AddPodToMesh(context.Context, *corev1.Pod, enrollment.Options) error {
	return errors.New("netns not found")
}

func (failingMesh) Redirection(types.UID) Redirection { return RedirectionNone }

// OnRepair hears each repair with istio-cni's type and result values.
func TestRepairOutcomesAreReported(t *testing.T) {
	cases := []struct {
		name       string
		mode       RepairMode
		mesh       Mesh
		labelled   bool
		podMissing bool
		want       [2]string
		wantErr    bool
	}{
		{name: "in place", mode: RepairInPlace, mesh: nopMesh{}, want: [2]string{"repair", "success"}},
		{name: "in place fails", mode: RepairInPlace, mesh: failingMesh{}, want: [2]string{"repair", "fail"}, wantErr: true},
		{name: "delete", mode: RepairDelete, mesh: nopMesh{}, want: [2]string{"delete", "success"}},
		{name: "delete a pod already gone", mode: RepairDelete, mesh: nopMesh{}, podMissing: true, want: [2]string{"delete", "skip"}},
		{name: "label", mode: RepairLabel, mesh: nopMesh{}, want: [2]string{"label", "success"}},
		{name: "label a labelled pod", mode: RepairLabel, mesh: nopMesh{}, labelled: true, want: [2]string{"label", "skip"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var got [][2]string
			cfg, err := Config{NodeName: "n", Repair: RepairConfig{Mode: tc.mode},
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
			r := newReconciler(cfg, tc.mesh, nil, w)
			r.log = slog.New(slog.DiscardHandler)
			err = r.repair(context.Background(), pod, enrollment.Decision{Ambient: true})
			if (err != nil) != tc.wantErr {
				t.Errorf("repair: %v", err)
			}
			if len(got) != 1 || got[0] != tc.want {
				t.Errorf("OnRepair heard %v, want [%v]", got, tc.want)
			}
		})
	}
}
