// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"
)

// CNIAdd is a pod's sandbox as the CNI plugin reports it, with the pod and
// namespace the agent read for it.
type CNIAdd struct {
	Pod         *corev1.Pod
	Namespace   *corev1.Namespace // nil when it does not exist
	UID         string            // K8S_POD_UID; "" when the runtime does not pass it
	ContainerID string
	Netns       string
	Interface   string
	IPs         []netip.Addr
}

// CNIResult is the answer to a CNIAdd.
type CNIResult struct {
	Enrolled bool
	Reason   string
}

// CNIAdd enrolls a new pod before its app starts. It fails whenever an
// ambient pod could not be fully enrolled, ztunnel's ack included: fail
// closed (an error wrapping zds.ErrNoZtunnel when none is connected).
func (r *Reconciler) CNIAdd(ctx context.Context, req CNIAdd) (CNIResult, error) {
	pod := req.Pod
	key := pod.Namespace + "/" + pod.Name
	if req.UID != "" && pod.UID != "" && string(pod.UID) != req.UID {
		return CNIResult{}, fmt.Errorf("pod %s: the runtime names uid %s, the API %s", key, req.UID, pod.UID)
	}
	dec := r.decide(pod, req.Namespace)
	if !dec.Ambient {
		return CNIResult{Reason: string(dec.Reason)}, nil
	}
	uid := req.UID
	if uid == "" {
		uid = string(pod.UID)
	}
	unlock := r.lockKey(key)
	defer unlock()
	mb := &member{uid: uid, namespace: pod.Namespace, name: pod.Name, serviceAccount: pod.Spec.ServiceAccountName,
		netns: req.Netns, containerID: req.ContainerID, iface: req.Interface, ips: req.IPs, opts: dec.Options}
	r.mu.Lock()
	if d := r.desired[key]; d.pod != nil && string(d.pod.UID) == uid {
		mb.claimed = true // the source reported it already
	}
	r.mu.Unlock()
	if _, err := r.add(ctx, mb, true); err != nil {
		return CNIResult{}, err
	}
	// The annotation follows: the pod as its source reports it, or as the
	// agent read it for this ADD.
	r.publish(Change{Pod: pod, UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Reason: dec.Reason})
	return CNIResult{Enrolled: true, Reason: string(dec.Reason)}, nil
}

// CNIDel is a sandbox going away, as the CNI plugin reports it.
type CNIDel struct {
	UID, Namespace, Name, ContainerID, Netns string
}

// CNIDel removes a pod whose sandbox goes away. Without a UID (not every
// runtime passes it) the pod is found among the members (delTarget). A DEL
// about an older sandbox of a pod, or that matches no member, removes
// nothing.
func (r *Reconciler) CNIDel(ctx context.Context, req CNIDel) error {
	key := req.Namespace + "/" + req.Name
	mb := r.delTarget(req)
	if mb == nil {
		r.log.Info("cni del matches no enrolled pod", "pod", key, "uid", req.UID, "container", req.ContainerID, "netns", req.Netns)
		return nil
	}
	unlock := r.lockKey(mb.key())
	defer unlock()
	// The informers see the pod change next; its reconcile publishes.
	return r.remove(ctx, mb)
}

// delTarget returns the member a DEL is about, or nil. With a uid it is
// that pod, unless it was enrolled from another sandbox (a late or repeated
// DEL of a sandbox it replaced). Without one it is the member delMatch
// ranks best, when exactly one is; a tie removes nothing.
func (r *Reconciler) delTarget(p CNIDel) *member {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p.UID != "" {
		mb := r.members[p.UID]
		if mb == nil {
			// Not held: nothing of ours, but the data path may still
			// have it (a DEL racing a removal); Remove is idempotent.
			return &member{uid: p.UID, namespace: p.Namespace, name: p.Name}
		}
		if differ(mb.containerID, p.ContainerID) {
			return nil
		}
		c := *mb
		return &c
	}
	var best *member
	bestRank, ties := 0, 0
	for _, mb := range r.members {
		switch rank := r.delMatch(mb, p); {
		case rank > bestRank:
			best, bestRank, ties = mb, rank, 1
		case rank == bestRank && rank > 0:
			ties++
		}
	}
	if ties != 1 {
		return nil
	}
	c := *best
	return &c
}

// delMatch ranks how surely member mb is the pod a DEL without uid names:
// 3 the same sandbox (container id), 2 the same netns, 1 the same namespace
// and name, 0 nothing in common or a contradiction (another sandbox, netns
// or name than the member is known by).
func (r *Reconciler) delMatch(mb *member, p CNIDel) int {
	if differ(mb.containerID, p.ContainerID) || differ(mb.namespace, p.Namespace) || differ(mb.name, p.Name) {
		return 0
	}
	if mb.containerID != "" && mb.containerID == p.ContainerID {
		return 3
	}
	if mb.netns != "" && p.Netns != "" {
		if same, known := r.cfg.Netns.Same(mb.netns, p.Netns); same {
			return 2
		} else if known {
			return 0
		}
	}
	if p.Namespace != "" && p.Name != "" {
		return 1 // the names agree: differ passed them
	}
	return 0
}

// differ reports whether a field known on both sides holds different values.
func differ(known, given string) bool { return known != "" && given != "" && known != given }
