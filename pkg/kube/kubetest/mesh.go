// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package kubetest holds a recording fake of kube.Mesh for tests of the
// controller and of code that wires it.
package kubetest

import (
	"context"
	"sync"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Op names a Mesh call.
type Op string

const (
	OpAdd    Op = "add"
	OpRemove Op = "remove"
)

// Call is one recorded AddPodToMesh or RemovePodFromMesh.
type Call struct {
	Op   Op
	Pod  string // namespace/name
	UID  types.UID
	Opts enrollment.Options
}

// Mesh is a fake kube.Mesh: it records calls and keeps each pod's state.
// Safe for concurrent use.
type Mesh struct {
	mu    sync.Mutex
	state map[types.UID]kube.Redirection
	calls []Call
	// pending makes AddPodToMesh leave pods pending until Ack.
	pending bool
	addErr  error
}

var _ kube.Mesh = (*Mesh)(nil)

// NewMesh returns a fake whose AddPodToMesh enables pods at once.
func NewMesh() *Mesh { return &Mesh{state: map[types.UID]kube.Redirection{}} }

// SetPending makes later AddPodToMesh calls leave pods pending (ztunnel has
// not acked) until Ack.
func (m *Mesh) SetPending(pending bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pending = pending
}

// FailAdd makes AddPodToMesh return err (nil to succeed again).
func (m *Mesh) FailAdd(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.addErr = err
}

// Ack turns a pending pod enabled, as ztunnel's acknowledgement would.
func (m *Mesh) Ack(uid types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.state[uid] == kube.RedirectionPending {
		m.state[uid] = kube.RedirectionEnabled
	}
}

// Adopt marks a pod redirected without a call, as the agent does for the
// start-up snapshot whose dataplane state survived a restart.
func (m *Mesh) Adopt(uid types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.state[uid] = kube.RedirectionEnabled
}

// AddPodToMesh implements kube.Mesh.
func (m *Mesh) AddPodToMesh(_ context.Context, pod *corev1.Pod, opts enrollment.Options) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, Call{Op: OpAdd, Pod: pod.Namespace + "/" + pod.Name, UID: pod.UID, Opts: opts})
	if m.addErr != nil {
		return m.addErr
	}
	if m.pending {
		m.state[pod.UID] = kube.RedirectionPending
	} else {
		m.state[pod.UID] = kube.RedirectionEnabled
	}
	return nil
}

// RemovePodFromMesh implements kube.Mesh.
func (m *Mesh) RemovePodFromMesh(_ context.Context, pod *corev1.Pod) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls = append(m.calls, Call{Op: OpRemove, Pod: pod.Namespace + "/" + pod.Name, UID: pod.UID})
	delete(m.state, pod.UID)
	return nil
}

// Redirection implements kube.Mesh.
func (m *Mesh) Redirection(uid types.UID) kube.Redirection {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.state[uid]
}

// Calls returns the calls so far, in order.
func (m *Mesh) Calls() []Call {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Call(nil), m.calls...)
}

// CallsFor returns the calls for one pod UID.
func (m *Mesh) CallsFor(uid types.UID) []Call {
	var out []Call
	for _, c := range m.Calls() {
		if c.UID == uid {
			out = append(out, c)
		}
	}
	return out
}
