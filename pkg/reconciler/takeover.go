// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// Takeover moves running pods from istio-cni's redirection onto the data
// path in place (pkg/takeover); Config.Takeover nil turns it off. The
// reconciler asks it about every running pod it is about to redirect in
// place (adopted at start, or repaired), and about no pod of a CNI ADD:
// those start on the data path.
type Takeover interface {
	// Inspect looks at the pod's netns before the pod is enrolled.
	// TakeoverRefused: istio-cni's state there is not exactly its own, so
	// the pod stays on it (still handed to ztunnel) and is never touched.
	Inspect(ctx context.Context, p TakeoverPod) (TakeoverPlan, error)
	// Finish takes istio-cni's state out of an enrolled pod and off the
	// node. draining: connections istio-cni redirected still run; Finish
	// is called again after Config.DrainRecheck. Idempotent.
	Finish(ctx context.Context, p TakeoverPod) (draining bool, err error)
	// Forget: the pod left the node.
	Forget(uid string)
}

// TakeoverPod is a pod as the takeover sees it.
type TakeoverPod struct {
	UID, Namespace, Name string
	Netns                string
	IPs                  []netip.Addr
	Options              podopts.Options
	// Pinned: the data path had the pod before this agent started.
	Pinned bool
}

// TakeoverAction is what Inspect found to do.
type TakeoverAction int

const (
	// TakeoverNone: no istio-cni state; enrol as usual.
	TakeoverNone TakeoverAction = iota
	// TakeoverProceed: enrol, then Finish.
	TakeoverProceed
	// TakeoverRefused: leave the pod on istio-cni's rules.
	TakeoverRefused
)

// TakeoverPlan is Inspect's answer.
type TakeoverPlan struct {
	Action TakeoverAction
	Reason string // refused: why
}

// DefaultDrainRecheck is how often a draining pod's flows are counted again.
const DefaultDrainRecheck = 2 * time.Second

// The takeover step a member is at.
type takeoverStep int

const (
	takeoverDone    takeoverStep = iota // nothing to do
	takeoverInspect                     // Inspect (again, after a failure)
	takeoverFinish                      // enrolled; Finish until not draining
)

func (mb *member) takeoverPod(pinned bool) TakeoverPod {
	return TakeoverPod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Netns: mb.netns, IPs: mb.ips, Options: mb.opts, Pinned: pinned}
}

// takeOver moves mb along its takeover. A pod that istio-cni redirects
// is enrolled before anything of istio-cni's goes, so that one of the two
// redirects it at every moment; a refused pod stays with istio-cni.
func (r *Reconciler) takeOver(ctx context.Context, mb *member) error {
	key := mb.key()
	if mb.netns == "" {
		ns, err := r.findNetns(ctx, key, types.UID(mb.uid))
		if err != nil {
			return fmt.Errorf("istio-cni takeover of pod %s: find netns: %w", key, err)
		}
		mb.netns = ns.Path
		r.update(mb.uid, func(m *member) { m.netns = ns.Path })
	}
	if mb.takeover == takeoverInspect {
		plan, err := r.cfg.Takeover.Inspect(ctx, mb.takeoverPod(!mb.istioCNI))
		if err != nil {
			return err
		}
		switch plan.Action {
		case TakeoverRefused:
			if !mb.istioCNI {
				// Only a pod the data path did not have can be refused;
				// should one be, it must not be redirected twice.
				if err := r.cfg.Dataplane.Remove(ctx, mb.uid); err != nil {
					return fmt.Errorf("istio-cni takeover of pod %s refused: leave it to istio-cni: %w", key, err)
				}
			}
			r.update(mb.uid, func(m *member) { m.istioCNI, m.takeover, m.note = true, takeoverDone, plan.Reason })
			return nil
		case TakeoverNone:
			if err := r.enrollMember(ctx, mb); err != nil {
				return err
			}
			r.update(mb.uid, func(m *member) { m.istioCNI, m.takeover, m.note = false, takeoverDone, "" })
			return nil
		}
		if err := r.enrollMember(ctx, mb); err != nil {
			return err
		}
		mb.istioCNI, mb.takeover = false, takeoverFinish
		r.update(mb.uid, func(m *member) { m.istioCNI, m.takeover = false, takeoverFinish })
	}
	draining, err := r.cfg.Takeover.Finish(ctx, mb.takeoverPod(true))
	if err != nil {
		return err
	}
	if draining {
		r.queue.AddAfter(key, r.cfg.DrainRecheck)
		return nil
	}
	r.update(mb.uid, func(m *member) { m.takeover, m.note = takeoverDone, "" })
	return nil
}

// enrollMember enrolls a member istio-cni redirected so far.
func (r *Reconciler) enrollMember(ctx context.Context, mb *member) error {
	if !mb.istioCNI {
		return nil
	}
	p := dataplane.Pod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Netns: mb.netns,
		Interface: mb.iface, IPs: mb.ips, Options: mb.opts, Running: true}
	if err := r.enroll(ctx, p); err != nil {
		r.observeError("enroll")
		return fmt.Errorf("istio-cni takeover of pod %s: enroll in the dataplane: %w", mb.key(), err)
	}
	return nil
}

// planTakeover inspects a running pod the data path does not have before
// it is redirected in place: a refused pod stays with istio-cni, one that
// istio-cni redirects is finished once enrolled.
func (r *Reconciler) planTakeover(ctx context.Context, mb *member) error {
	if r.cfg.Takeover == nil {
		return nil
	}
	plan, err := r.cfg.Takeover.Inspect(ctx, mb.takeoverPod(false))
	if err != nil {
		return err
	}
	switch plan.Action {
	case TakeoverRefused:
		mb.istioCNI, mb.note = true, plan.Reason
	case TakeoverProceed:
		mb.takeover = takeoverFinish
	}
	return nil
}
