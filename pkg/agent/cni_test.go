// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

type fakeLookup struct{ pods map[string]*corev1.Pod }

func (f fakeLookup) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	p := f.pods[namespace+"/"+name]
	if p == nil {
		return nil, nil, errors.New("no such pod")
	}
	return p, nil, nil
}

type fakeCNIReconciler struct {
	got reconciler.CNIAdd
	err error
}

func (f *fakeCNIReconciler) CNIAdd(_ context.Context, req reconciler.CNIAdd) (reconciler.CNIResult, error) {
	f.got = req
	return reconciler.CNIResult{Enrolled: f.err == nil, Reason: "pod labelled ambient"}, f.err
}

func (f *fakeCNIReconciler) CNIDel(context.Context, reconciler.CNIDel) error { return nil }

// The CNI channel reads the pod, reports the sandbox and tells the plugin
// when no ztunnel is connected.
func TestCNIHandlerReportsTheSandboxAndNamesMissingZtunnel(t *testing.T) {
	web := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", UID: "uid-web"}}
	rec := &fakeCNIReconciler{}
	h := &cniHandler{lookup: fakeLookup{pods: map[string]*corev1.Pod{"shop/web": web}}, rec: rec}
	req := &cniv1.PodAddRequest{Pod: &cniv1.Pod{Namespace: "shop", Name: "web", Uid: "uid-web", Netns: "/run/netns/x", Interface: "eth0", ContainerId: "c1"},
		Ips: []string{"198.18.0.10"}}
	res, err := h.PodAdd(context.Background(), req)
	if err != nil || !res.Enrolled || rec.got.Pod != web || rec.got.Netns != "/run/netns/x" || rec.got.ContainerID != "c1" || len(rec.got.IPs) != 1 {
		t.Errorf("PodAdd = %+v, %v; reported %+v", res, err, rec.got)
	}
	rec.err = fmt.Errorf("hand pod shop/web to ztunnel: %w", zds.ErrNoZtunnel)
	if _, err := h.PodAdd(context.Background(), req); !errors.Is(err, events.ErrNoZtunnel) {
		t.Errorf("PodAdd without ztunnel = %v; want events.ErrNoZtunnel", err)
	}
	req.Ips = []string{"not-an-ip"}
	if _, err := h.PodAdd(context.Background(), req); err == nil {
		t.Error("PodAdd accepted a bad IP from the runtime")
	}
	req.Pod.Name = "ghost"
	if _, err := h.PodAdd(context.Background(), req); err == nil {
		t.Error("PodAdd of a pod the source does not have succeeded")
	}
}
