// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package takeover moves running pods from istio-cni's iptables (or
// nftables) redirection onto the eBPF data path in place, and hands them
// back on an uninstall that asks for it. It is what the reconciler calls
// (reconciler.Takeover) around an in-place enrolment; pkg/istiocni does the
// reading and writing of istio-cni's state.
//
// A pod's takeover, in an order that keeps it redirected at every moment:
//
//  1. Inspect: istio-cni's state in the pod must be exactly what istio-cni
//     writes (istiocni.Pod.Equivalent), or the pod is left on it, still
//     handed to ztunnel, and never touched. A pod holding the drain table
//     is one whose takeover began and was cut short: it is finished,
//     whatever is left of istio-cni's rules.
//     A pod to take over gets the drain (istiocni.InstallDrain) at once,
//     before anything else changes: it holds conntrack for the connections
//     istio-cni redirected, and it is the record that the takeover began.
//  2. The reconciler enrols the pod in eBPF (both redirect now: the same
//     ztunnel listeners, the same marks).
//  3. Finish: istio-cni's rules go (its return-path rule and routes stay:
//     the eBPF enrolment uses the very same ones), then the pod's IPs
//     leave istio-cni's probe ipsets on the node, and the node's probe rule
//     and sets once they are empty. Until the last redirected flow closes,
//     Finish reports the pod draining and the reconciler calls it again;
//     then the drain goes.
//
// The kernel state is the record: nothing is written elsewhere, so an
// agent killed at any step finds on restart what it needs to go on: the
// drain table says a takeover began, whatever is left of istio-cni's
// rules and whether or not the pins say eBPF has the pod yet.
package takeover

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// The failpoints of a takeover (Config.Failpoint), in order.
const (
	StepDrained  = "takeover-after-drain"  // the drain holds conntrack; the pod is not enrolled yet
	StepEnrolled = "takeover-after-enroll" // the pod is enrolled, istio-cni's rules still there
	StepRemoved  = "takeover-after-remove" // istio-cni's pod rules are gone, the node's probe entries not yet
)

// Steps lists the failpoints, in order.
var Steps = []string{StepDrained, StepEnrolled, StepRemoved}

// Results of a pod's takeover (Config.OnResult, the metric's label).
const (
	ResultTakenOver = "taken_over" // istio-cni's state is gone, eBPF redirects the pod
	ResultRefused   = "refused"    // istio-cni's state is not exactly its own: left on it
	ResultFailed    = "failed"     // a step failed; retried
)

// Results of a pod's hand-back.
const (
	ResultHandedBack = "handed_back"
	ResultHandFailed = "failed"
)

// RuleManager is what a takeover reads and removes istio-cni's state with
// (*istiocni.RuleManager).
type RuleManager interface {
	InspectPod(ctx context.Context, path string) (*istiocni.Pod, error)
	RemovePod(ctx context.Context, path string, o istiocni.RemoveOptions) error
	InspectNode(ctx context.Context, path string) (*istiocni.Node, error)
	RemoveNode(ctx context.Context, path string) error
	RemoveProbeEntries(ctx context.Context, path, uid string, ips []netip.Addr) error
	Missing() []string
}

// Drain is the conntrack drain of a pod netns (pkg/istiocni's functions).
type Drain interface {
	Install(ctx context.Context, path string) error
	Remove(ctx context.Context, path string) error
	Has(ctx context.Context, path string) (bool, error)
	Flows(ctx context.Context, path string) (int, error)
}

// KernelDrain is the drain pkg/istiocni installs.
type KernelDrain struct{}

func (KernelDrain) Install(ctx context.Context, path string) error {
	return istiocni.InstallDrain(ctx, path)
}
func (KernelDrain) Remove(ctx context.Context, path string) error {
	return istiocni.RemoveDrain(ctx, path)
}
func (KernelDrain) Has(ctx context.Context, path string) (bool, error) {
	return istiocni.HasDrain(ctx, path)
}
func (KernelDrain) Flows(ctx context.Context, path string) (int, error) {
	return istiocni.RedirectedFlows(ctx, path)
}

// Config configures a Takeover. Rules and NodeNetns are required.
type Config struct {
	Rules RuleManager
	Drain Drain // default KernelDrain
	// NodeNetns is the path of the node's netns, where istio-cni's probe
	// rule and ipsets are (the agent's own: /proc/self/ns/net).
	NodeNetns string
	Logger    *slog.Logger
	// OnResult counts a pod's takeover outcome (Result*); OnDraining
	// reports how many pods hold a drain now. Neither may block.
	OnResult   func(result string)
	OnDraining func(n int)
	// Failpoint, when set, is called at each Step (crash-injection tests).
	Failpoint func(step string)
}

// State is a pod's takeover as the CLI shows it.
type State struct {
	UID, Namespace, Name string
	// Phase: "left on istio-cni" (refused), "removing" (enrolled, istio-cni's
	// state not all gone yet), "draining" (connections istio-cni
	// redirected still run), "taken over".
	Phase  string
	Flows  int    // draining: the redirected flows left
	Reason string // refused or failing: why
}

// Phases.
const (
	PhaseLeft      = "left on istio-cni"
	PhaseRemoving  = "removing istio-cni's rules"
	PhaseDraining  = "draining istio-cni's connections"
	PhaseTakenOver = "taken over"
)

// Takeover implements reconciler.Takeover. Build it with New.
type Takeover struct {
	cfg Config
	log *slog.Logger

	nodeMu sync.Mutex // one node cleanup at a time

	mu     sync.Mutex
	states map[string]State // by uid
}

var _ reconciler.Takeover = (*Takeover)(nil)

// New builds a Takeover; it does no I/O.
func New(cfg Config) (*Takeover, error) {
	if cfg.Rules == nil || cfg.NodeNetns == "" {
		return nil, errors.New("takeover config: a rule manager and the node netns are required")
	}
	if cfg.Drain == nil {
		cfg.Drain = KernelDrain{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	t := &Takeover{cfg: cfg, log: cfg.Logger, states: map[string]State{}}
	if m := cfg.Rules.Missing(); len(m) > 0 {
		t.log.Warn("istio-cni takeover: these binaries are missing, the state of their backends is neither seen nor removed", "missing", m)
	}
	return t, nil
}

// Inspect implements reconciler.Takeover.
func (t *Takeover) Inspect(ctx context.Context, p reconciler.TakeoverPod) (reconciler.TakeoverPlan, error) {
	log := t.log.With("pod", p.Namespace+"/"+p.Name, "uid", p.UID, "netns", p.Netns)
	began, err := t.cfg.Drain.Has(ctx, p.Netns)
	if err != nil {
		return reconciler.TakeoverPlan{}, fmt.Errorf("istio-cni takeover of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	if began {
		log.Info("istio-cni takeover: found one begun earlier; finishing it")
		t.set(p, PhaseRemoving, 0, "")
		return reconciler.TakeoverPlan{Action: reconciler.TakeoverProceed}, nil
	}
	if p.Pinned {
		// eBPF has had the pod since before this agent started, and no
		// takeover is under way: istio-cni's rules are not there (an
		// inspection per pod would make every restart slow).
		return reconciler.TakeoverPlan{}, nil
	}
	ip, err := t.cfg.Rules.InspectPod(ctx, p.Netns)
	if err != nil {
		return reconciler.TakeoverPlan{}, fmt.Errorf("istio-cni takeover of pod %s/%s: inspect: %w", p.Namespace, p.Name, err)
	}
	if len(ip.Iptables) == 0 && ip.Nft == nil {
		// Nothing of istio-cni's, or only a return path: the very one the
		// eBPF enrolment installs (a pod whose pins were lost has it).
		return reconciler.TakeoverPlan{}, nil
	}
	if !ip.Equivalent {
		reason := strings.Join(ip.Reasons, "; ")
		log.Warn("istio-cni takeover refused: the pod's rules are not exactly istio-cni's; left on them, untouched", "backends", ip.Backends(), "reason", reason)
		t.set(p, PhaseLeft, 0, reason)
		t.result(ResultRefused)
		return reconciler.TakeoverPlan{Action: reconciler.TakeoverRefused, Reason: reason}, nil
	}
	want := p.Options
	if !ip.Options.Equal(want) {
		// istio-cni writes a pod's rules once, at its start: the pod's
		// annotations changed since. A new pod would get want, so does this one.
		log.Info("istio-cni takeover: the pod's rules express other options than its annotations ask for; enrolling with the annotations'", "rules", ip.Options.String(), "annotations", want.String())
	}
	// The drain first: the record that the takeover began, for an agent
	// killed before it ends (the pod may be enrolled by then or not).
	if err := t.cfg.Drain.Install(ctx, p.Netns); err != nil {
		return reconciler.TakeoverPlan{}, fmt.Errorf("istio-cni takeover of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	t.failpoint(StepDrained)
	log.Info("istio-cni takeover: the pod holds istio-cni's rules; drain in place, enrolling it in eBPF first", "backends", ip.Backends())
	t.set(p, PhaseRemoving, 0, "")
	return reconciler.TakeoverPlan{Action: reconciler.TakeoverProceed}, nil
}

// Finish implements reconciler.Takeover.
func (t *Takeover) Finish(ctx context.Context, p reconciler.TakeoverPod) (draining bool, err error) {
	defer func() {
		if err != nil {
			t.set(p, PhaseRemoving, 0, err.Error())
			t.result(ResultFailed)
		}
	}()
	key := p.Namespace + "/" + p.Name
	log := t.log.With("pod", key, "uid", p.UID, "netns", p.Netns)
	if t.phase(p.UID) == PhaseRemoving {
		t.failpoint(StepEnrolled)
		// The drain is in place since Inspect: removing istio-cni's rules
		// does not turn conntrack off under its connections
		// (istiocni.DrainTable).
		if err := t.cfg.Rules.RemovePod(ctx, p.Netns, istiocni.RemoveOptions{KeepReturnPath: true}); err != nil {
			return false, fmt.Errorf("istio-cni takeover of pod %s: remove istio-cni's rules: %w", key, err)
		}
		t.failpoint(StepRemoved)
		if err := t.cleanNode(ctx, p); err != nil {
			return false, fmt.Errorf("istio-cni takeover of pod %s: %w", key, err)
		}
		log.Info("istio-cni takeover: istio-cni's rules removed; eBPF redirects the pod")
		t.result(ResultTakenOver)
	}
	n, err := t.cfg.Drain.Flows(ctx, p.Netns)
	if err != nil {
		return false, fmt.Errorf("istio-cni takeover of pod %s: %w", key, err)
	}
	if n > 0 {
		t.set(p, PhaseDraining, n, "")
		return true, nil
	}
	if err := t.cfg.Drain.Remove(ctx, p.Netns); err != nil {
		return false, fmt.Errorf("istio-cni takeover of pod %s: %w", key, err)
	}
	log.Info("istio-cni takeover: done, no connection istio-cni redirected is left")
	t.set(p, PhaseTakenOver, 0, "")
	return false, nil
}

// cleanNode takes the pod's IPs out of istio-cni's probe ipsets, and the
// node's probe rule and sets once no pod is in them.
func (t *Takeover) cleanNode(ctx context.Context, p reconciler.TakeoverPod) error {
	t.nodeMu.Lock()
	defer t.nodeMu.Unlock()
	if err := t.cfg.Rules.RemoveProbeEntries(ctx, t.cfg.NodeNetns, p.UID, p.IPs); err != nil {
		return fmt.Errorf("remove the pod's istio-cni probe entries: %w", err)
	}
	n, err := t.cfg.Rules.InspectNode(ctx, t.cfg.NodeNetns)
	if err != nil {
		return fmt.Errorf("inspect istio-cni's node state: %w", err)
	}
	if !n.Found() || n.Entries() > 0 {
		return nil
	}
	if err := t.cfg.Rules.RemoveNode(ctx, t.cfg.NodeNetns); err != nil {
		return fmt.Errorf("remove istio-cni's node state: %w", err)
	}
	t.log.Info("istio-cni takeover: no pod is left in istio-cni's probe sets; its node probe rule and sets removed")
	return nil
}

// Forget implements reconciler.Takeover: the pod left the node.
func (t *Takeover) Forget(uid string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.states, uid)
	t.reportDraining()
}

// States returns the pods a takeover saw, in no order.
func (t *Takeover) States() []State {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]State, 0, len(t.states))
	for _, s := range t.states {
		out = append(out, s)
	}
	return out
}

func (t *Takeover) phase(uid string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.states[uid].Phase
}

func (t *Takeover) set(p reconciler.TakeoverPod, phase string, flows int, reason string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.states[p.UID] = State{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Phase: phase, Flows: flows, Reason: reason}
	t.reportDraining()
}

func (t *Takeover) reportDraining() {
	if t.cfg.OnDraining == nil {
		return
	}
	n := 0
	for _, s := range t.states {
		if s.Phase == PhaseDraining {
			n++
		}
	}
	t.cfg.OnDraining(n)
}

func (t *Takeover) result(r string) {
	if t.cfg.OnResult != nil {
		t.cfg.OnResult(r)
	}
}

func (t *Takeover) failpoint(step string) {
	if t.cfg.Failpoint != nil {
		t.cfg.Failpoint(step)
	}
}
