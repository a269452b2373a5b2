// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
)

// Adopt takes over, before Run, what a previous agent left: the pods the
// data path still redirects and the snapshot, the pods annotated enabled
// on this node (contract section 6). Snapshot pods whose netns is found are
// enrolled again in place (their state stays enabled: ztunnel had them and
// gets them again in the snapshot of its next connection, so the annotation
// does not flap through pending on a restart); those without a netns keep
// their pins and go to ztunnel as a Keep. Every adopted pod is reconciled
// once the sources synced: one that is gone or no longer ambient leaves then.
func (r *Reconciler) Adopt(ctx context.Context, snapshot []*corev1.Pod) {
	adopted := map[string]inspect.EnrolledPod{}
	for _, p := range r.cfg.Dataplane.List() {
		adopted[p.UID] = p
	}
	// One scan of /proc for every pod: a scan per pod made a restart with
	// a thousand pods quadratic.
	netnsOf, err := r.netns.since(ctx, r.netns.next())
	if err != nil {
		r.log.Warn("scan for pods' netns failed", "error", err)
		netnsOf = map[types.UID]podnetns.NetNS{}
	}
	seen := map[string]bool{}
	for _, pod := range snapshot {
		uid := string(pod.UID)
		seen[uid] = true
		key := pod.Namespace + "/" + pod.Name
		// The options as the pod asks for them; whether it still belongs
		// in the mesh is decided once the sources synced.
		mb := &member{uid: uid, namespace: pod.Namespace, name: pod.Name, serviceAccount: pod.Spec.ServiceAccountName,
			ips: podIPs(pod), opts: enrollment.PodOptions(r.cfg.Enrollment, pod), redirection: enrollment.RedirectionEnabled, claimed: true}
		ns, ok := netnsOf[pod.UID]
		if !ok {
			err := fmt.Errorf("pod uid %s: %w", pod.UID, podnetns.ErrNotFound)
			a, pinned := adopted[uid]
			if !pinned {
				r.log.Warn("snapshot pod has no netns and no pinned state; left to repair", "pod", key, "error", err)
				continue
			}
			mb.opts, mb.iface = a.Options.Clone(), a.Interface
			r.put(mb) // keep the pins; ztunnel gets a Keep
			r.queue.Add(key)
			continue
		}
		mb.netns = ns.Path
		a, pinned := adopted[uid]
		if pinned {
			mb.iface = a.Interface
		}
		if r.cfg.Takeover != nil {
			// Inspected by a worker, before anything else happens to the
			// pod: one the data path does not have yet may be istio-cni's,
			// and stays with it (handed to ztunnel all the same) until then.
			mb.takeover = takeoverInspect
			if !pinned {
				mb.istioCNI = true
				r.put(mb)
				r.queue.Add(key)
				continue
			}
		}
		if err := r.enroll(ctx, dataplane.Pod{UID: uid, Namespace: pod.Namespace, Name: pod.Name, Netns: mb.netns,
			Interface: mb.iface, IPs: mb.ips, Options: mb.opts, Running: true}); err != nil {
			r.log.Error("re-enrolling snapshot pod failed", "pod", key, "error", err)
			a, pinned := adopted[uid]
			if !pinned {
				continue
			}
			mb.opts = a.Options.Clone()
		}
		r.put(mb)
		r.queue.Add(key)
	}
	for uid, p := range adopted {
		if seen[uid] {
			continue
		}
		mb := &member{uid: uid, namespace: p.Namespace, name: p.Name, iface: p.Interface, ips: p.IPs,
			opts: p.Options.Clone(), redirection: enrollment.RedirectionEnabled, claimed: true}
		if r.cfg.Takeover != nil {
			mb.takeover = takeoverInspect // a takeover cut short finishes
		}
		if found, ok := netnsOf[types.UID(uid)]; ok {
			mb.netns = found.Path
		}
		if p.Problem != "" && mb.netns != "" && len(mb.ips) > 0 {
			// Its entries are not all in place (the data path could
			// not restore them): enrolled again in place, which writes
			// them unless another running pod has the address.
			r.log.Warn("adopted pod is not fully redirected; enrolling it again", "pod", mb.key(), "uid", uid, "problem", p.Problem)
			if err := r.enroll(ctx, dataplane.Pod{UID: uid, Namespace: p.Namespace, Name: p.Name, Netns: mb.netns,
				Interface: mb.iface, IPs: mb.ips, Options: p.Options, Running: true}); err != nil {
				r.log.Error("re-enrolling adopted pod failed", "pod", mb.key(), "error", err)
			}
		}
		r.put(mb)
		r.queue.Add(mb.key())
	}
}
