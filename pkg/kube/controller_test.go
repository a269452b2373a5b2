// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// recordingSink records what the controller reports.
type recordingSink struct {
	mu     sync.Mutex
	set    map[string]*corev1.Namespace // namespace/name: the namespace reported with the pod
	synced bool
}

func (s *recordingSink) SetPod(pod *corev1.Pod, ns *corev1.Namespace) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.set == nil {
		s.set = map[string]*corev1.Namespace{}
	}
	s.set[pod.Namespace+"/"+pod.Name] = ns
}
func (s *recordingSink) DeletePod(string, string) {}
func (s *recordingSink) Synced()                  { s.mu.Lock(); s.synced = true; s.mu.Unlock() }

func testPod() *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{
		Namespace: "ns", Name: "app", UID: "uid-1", ResourceVersion: "42",
	}}
}

func TestNewDoesNoIO(t *testing.T) {
	client := fake.NewClientset()
	if _, err := New(Config{NodeName: "n1"}, client); err != nil {
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
			if _, err := New(tc.cfg, fake.NewClientset()); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New = %v; want an error about %s", err, tc.want)
			}
		})
	}
}

func TestRedirectionAnnotationIsMergePatchedThroughStatus(t *testing.T) {
	cases := []struct {
		state enrollment.Redirection
		want  any
	}{
		{enrollment.RedirectionEnabled, "enabled"},
		{enrollment.RedirectionPending, "pending"},
		{enrollment.RedirectionNone, nil},
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

// The controller reports each pod with its namespace read from the cache,
// so the reconciler decides new and running pods alike.
func TestPodsAreReportedWithTheirNamespaceFromTheCache(t *testing.T) {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "ns", Labels: map[string]string{
		enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient,
	}}}
	pod := testPod()
	pod.Spec.NodeName = "n1"
	sink := &recordingSink{}
	c, err := New(Config{NodeName: "n1"}, fake.NewClientset(ns, pod))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := c.Start(ctx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx, sink) }()
	for {
		sink.mu.Lock()
		synced, got := sink.synced, sink.set["ns/app"]
		sink.mu.Unlock()
		if synced {
			d := enrollment.Decide(enrollment.DefaultConfig(), testPod(), got)
			if !d.Ambient || d.Reason != enrollment.ReasonNamespaceLabel {
				t.Errorf("Decide with the reported namespace = %+v; want ambient through the namespace label", d)
			}
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Error(err)
	}
}
