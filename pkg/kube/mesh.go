// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package kube is the node agent's Kubernetes control plane (contract
// sections 5 and 6): it watches the pods of its own node and all namespaces,
// decides with pkg/enrollment which pods belong in the mesh, asks the agent's
// Mesh to add or remove them, and publishes the result as the
// ambient.istio.io/redirection annotation on the pod's status.
//
// Informer handlers only enqueue keys; a rate-limited work queue runs the
// reconcile, one pod key at a time, so the decisions for one pod are never
// concurrent. The same reconcile also serves the standalone pod file
// (FileSource) on nodes without Kubernetes.
//
// Start-up follows the contract's order and the agent drives it:
//
//	c, err := kube.New(cfg, client, mesh) // no I/O
//	err = c.Start(ctx)                    // informers running, caches synced
//	snap, err := c.Snapshot()             // pods annotated enabled on this node
//	... find their netns (pkg/podnetns), adopt them in the dataplane ...
//	go c.Run(ctx)                         // handlers and workers until ctx ends
//
// While it runs, the agent's CNI path decides new pods with c.Decide and
// calls the Mesh itself; the controller then only publishes the annotation.
// When ztunnel acks a pending pod, the agent calls c.Requeue.
//
// A running pod that should be ambient but is not redirected (it started
// before the agent was ready, was labelled after it started, or its state
// was lost) is repaired as RepairConfig says: in place (default), deleted,
// or labelled, with a Kubernetes Event each time.
package kube

import (
	"context"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Redirection is a pod's redirection state as the dataplane sees it; its
// non-empty values are those of the ambient.istio.io/redirection annotation.
type Redirection string

const (
	// RedirectionNone: the dataplane does not redirect the pod.
	RedirectionNone Redirection = ""
	// RedirectionPending: traffic is redirected but ztunnel has not yet
	// acknowledged the pod.
	RedirectionPending Redirection = enrollment.RedirectionPending
	// RedirectionEnabled: redirected, and ztunnel acknowledged the pod.
	RedirectionEnabled Redirection = enrollment.RedirectionEnabled
)

// Mesh is what the agent implements for this package: the dataplane and the
// ztunnel handoff behind one door. Pods are identified by UID, never by IP or
// name, so a recycled IP or a recreated StatefulSet pod is a different pod.
//
// The controller calls AddPodToMesh and RemovePodFromMesh from its workers,
// one call per pod at a time; different pods may be handled concurrently.
// Redirection must be cheap (no I/O): it is read on every reconcile.
type Mesh interface {
	// AddPodToMesh redirects a running pod's traffic in place (its netns is
	// the agent's to find, see pkg/podnetns) and hands the pod to ztunnel.
	// It must be idempotent: a pod already in the mesh is updated to opts.
	AddPodToMesh(ctx context.Context, pod *corev1.Pod, opts enrollment.Options) error
	// RemovePodFromMesh removes the redirection of the pod with pod.UID and
	// tells ztunnel; a pod that is not in the mesh is not an error.
	RemovePodFromMesh(ctx context.Context, pod *corev1.Pod) error
	// Redirection reports the pod's current state. When it later changes
	// on its own (ztunnel acked a pending pod), the agent calls
	// Controller.Requeue so the annotation follows.
	Redirection(uid types.UID) Redirection
}
