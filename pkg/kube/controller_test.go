// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

type nopMesh struct{}

func (nopMesh) AddPodToMesh(context.Context, *corev1.Pod, enrollment.Options) error { return nil }
func (nopMesh) RemovePodFromMesh(context.Context, *corev1.Pod) error                { return nil }
func (nopMesh) Redirection(types.UID) Redirection                                   { return RedirectionNone }

func testPod() *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: "ns", Name: "app", UID: "uid-1", ResourceVersion: "42",
	}}
}

func TestNewDoesNoIO(t *testing.T) {
	client := fake.NewClientset()
	if _, err := New(Config{NodeName: "n1"}, client, nopMesh{}); err != nil {
		t.Fatal(err)
	}
	if a := client.Actions(); len(a) != 0 {
		t.Errorf("New made %d API calls (%v); want none", len(a), a)
	}
}

func TestNewRefusesBadConfig(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no node name", Config{}, "node name"},
		{"unknown repair mode", Config{NodeName: "n1", Repair: RepairConfig{Mode: "reboot"}}, "repair mode"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(tc.cfg, fake.NewClientset(), nopMesh{}); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New = %v; want an error about %s", err, tc.want)
			}
		})
	}
}

func TestRedirectionAnnotationIsMergePatchedThroughStatus(t *testing.T) {
	cases := []struct {
		state Redirection
		want  any
	}{
		{RedirectionEnabled, "enabled"},
		{RedirectionPending, "pending"},
		{RedirectionNone, nil},
	}
	for _, tc := range cases {
		t.Run(string(tc.state)+"|", func(t *testing.T) {
			client := fake.NewClientset(testPod())
			w := &apiWriter{client: client}
			if err := w.setRedirection(context.Background(), testPod(), tc.state); err != nil {
				t.Fatal(err)
			}
			patch := onlyAction[k8stesting.PatchAction](t, client)
			if patch.GetSubresource() != "status" || patch.GetPatchType() != types.MergePatchType {
				t.Fatalf("patch on subresource %q type %s; want status, merge", patch.GetSubresource(), patch.GetPatchType())
			}
			var body struct {
				Metadata struct {
					UID         string         `json:"uid"`
					Annotations map[string]any `json:"annotations"`
				} `json:"metadata"`
			}
			if err := json.Unmarshal(patch.GetPatch(), &body); err != nil {
				t.Fatal(err)
			}
			v, ok := body.Metadata.Annotations["ambient.istio.io/redirection"]
			if !ok || v != tc.want || body.Metadata.UID != "uid-1" {
				t.Errorf("patch = %s; want the pod's uid and redirection %v", patch.GetPatch(), tc.want)
			}
		})
	}
}

func TestRepairDeleteCarriesUIDAndResourceVersionPreconditions(t *testing.T) {
	client := fake.NewClientset(testPod())
	if err := (&apiWriter{client: client}).deletePod(context.Background(), testPod()); err != nil {
		t.Fatal(err)
	}
	del := onlyAction[k8stesting.DeleteActionImpl](t, client)
	pre := del.DeleteOptions.Preconditions
	if pre == nil || pre.UID == nil || *pre.UID != "uid-1" || pre.ResourceVersion == nil || *pre.ResourceVersion != "42" {
		t.Errorf("delete preconditions = %+v; want uid-1 at resourceVersion 42", pre)
	}
}

func onlyAction[T any](t *testing.T, client *fake.Clientset) T {
	t.Helper()
	actions := client.Actions()
	if len(actions) != 1 {
		t.Fatalf("actions = %v; want one", actions)
	}
	a, ok := actions[0].(T)
	if !ok {
		t.Fatalf("action %T; want %T", actions[0], a)
	}
	return a
}

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
			p := testPod()
			for _, s := range tc.states {
				p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{State: s})
			}
			if got := runsUnredirected(p); got != tc.want {
				t.Errorf("runsUnredirected = %v; want %v", got, tc.want)
			}
		})
	}
}

func TestDecideReadsTheNamespaceFromTheCache(t *testing.T) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns", Labels: map[string]string{
		enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient,
	}}}
	c, err := New(Config{NodeName: "n1", Enrollment: enrollment.DefaultConfig()}, fake.NewClientset(ns), nopMesh{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	d, err := c.Decide(testPod())
	if err != nil || !d.Ambient || d.Reason != enrollment.ReasonNamespaceLabel {
		t.Errorf("Decide = %+v, %v; want ambient through the namespace label", d, err)
	}
}
