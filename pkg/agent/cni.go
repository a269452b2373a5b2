// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// podLookup reads a pod and its namespace for a CNI ADD: the Kubernetes
// source's caches (or a direct read), or the pod file.
type podLookup interface {
	Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error)
}

// cniReconciler is the reconciler as the CNI channel uses it.
type cniReconciler interface {
	CNIAdd(ctx context.Context, req reconciler.CNIAdd) (reconciler.CNIResult, error)
	CNIDel(ctx context.Context, req reconciler.CNIDel) error
}

// cniHandler is the CNI plugin's channel as a source: it reads the pod of
// an ADD and reports the sandbox to the reconciler, which decides and
// answers (events.Handler).
type cniHandler struct {
	lookup podLookup
	rec    cniReconciler
}

// PodAdd enrolls a new pod before its app starts; it fails whenever an
// ambient pod could not be fully enrolled: fail closed.
func (h *cniHandler) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (events.AddResult, error) {
	p := req.GetPod()
	key := p.GetNamespace() + "/" + p.GetName()
	pod, ns, err := h.lookup.Lookup(ctx, p.GetNamespace(), p.GetName())
	if err != nil {
		return events.AddResult{}, err
	}
	var ips []netip.Addr
	for _, s := range req.GetIps() {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return events.AddResult{}, fmt.Errorf("pod %s: bad IP %q from the runtime: %w", key, s, err)
		}
		ips = append(ips, a)
	}
	res, err := h.rec.CNIAdd(ctx, reconciler.CNIAdd{Pod: pod, Namespace: ns, UID: p.GetUid(), ContainerID: p.GetContainerId(),
		Netns: p.GetNetns(), Interface: p.GetInterface(), IPs: ips})
	if errors.Is(err, zds.ErrNoZtunnel) {
		return events.AddResult{}, fmt.Errorf("pod %s: %w", key, errors.Join(events.ErrNoZtunnel, err))
	}
	if err != nil {
		return events.AddResult{}, err
	}
	return events.AddResult{Enrolled: res.Enrolled, Reason: res.Reason}, nil
}

// PodDel removes a pod whose sandbox goes away.
func (h *cniHandler) PodDel(ctx context.Context, req *cniv1.PodDelRequest) error {
	p := req.GetPod()
	return h.rec.CNIDel(ctx, reconciler.CNIDel{UID: p.GetUid(), Namespace: p.GetNamespace(), Name: p.GetName(),
		ContainerID: p.GetContainerId(), Netns: p.GetNetns()})
}
