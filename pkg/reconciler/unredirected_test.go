// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestRunsUnredirected(t *testing.T) {
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	term := func(reason string, code int32) corev1.ContainerState {
		return corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{Reason: reason, ExitCode: code}}
	}
	cases := []struct {
		name   string
		states []corev1.ContainerState
		want   bool
	}{
		{"running container", []corev1.ContainerState{running}, true},
		{"no container status yet", nil, true},
		{"completed", []corev1.ContainerState{term("Completed", 0)}, false},
		{"exit code 0 whatever the reason", []corev1.ContainerState{term("OOMKilled", 0)}, false},
		{"reason Completed whatever the code", []corev1.ContainerState{term("Completed", 2)}, false},
		{"failed", []corev1.ContainerState{term("Error", 1)}, true},
		{"completed and running", []corev1.ContainerState{term("Completed", 0), running}, true},
		{"waiting", []corev1.ContainerState{{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}}, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := &corev1.Pod{}
			for _, s := range tc.states {
				p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{State: s})
			}
			if got := RunsUnredirected(p); got != tc.want {
				t.Errorf("RunsUnredirected = %v; want %v", got, tc.want)
			}
		})
	}
}
