// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package reconciler is the node agent's control plane: one loop that owns,
// per pod, the desired state (what the sources report) and the observed
// state (what the data path and ztunnel hold), and brings the second to the
// first.
//
//	sources                      reconciler                        drives
//	pkg/kube (informers)   --\                                /--> pkg/dataplane
//	pkg/standalone (file)  ---+-> SetPod / DeletePod / Synced -+
//	CNI ADD/DEL (agent)    --/    CNIAdd / CNIDel             \--> pkg/zds
//	                                     |           ^
//	                                     |           '---- zds.Ack events
//	                                     v
//	                       Change -> listeners (pkg/kube's status writer:
//	                                 annotation, Events, repair; metrics)
//
// Sources only report: they never decide and are never called back. Which
// pods belong in the mesh is decided in one place, decide, with
// pkg/enrollment's rules, for the informers, the pod file and the CNI
// plugin alike. The reconciler imports no source; the import graph test
// holds that.
//
// Work runs on a client-go rate-limited work queue keyed by
// namespace/name, so one pod is never reconciled twice at once, and a
// failure (a data path error, a NACK from ztunnel) is retried with per-pod
// exponential backoff and a cap, as istio-cni requeues. ztunnel's answers
// arrive as events (zds.Config.OnAck): an ack turns a pending pod enabled
// at once, with no polling.
package reconciler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// Repair says what a Change reports about a running ambient pod that the
// data path did not redirect.
type Repair int

const (
	// RepairNothing: nothing to repair.
	RepairNothing Repair = iota
	// RepairedInPlace: the running pod was just redirected in place.
	RepairedInPlace
	// RepairFailed: redirecting the running pod in place failed (Change.Err);
	// it is retried with backoff.
	RepairFailed
	// Unredirected: the pod runs unredirected and Config.RepairInPlace is
	// off; what to do (delete, label, nothing) is the listener's.
	Unredirected
)

// Change is the state of one pod after the reconciler acted on it or
// ztunnel answered about it. Listeners get one after every reconcile of a
// pod the sources know, changed or not, so a listener that failed to
// write one sees the next.
type Change struct {
	// Pod is the pod as its source last reported it; nil for a pod no
	// source reports (a CNI ADD the informers have not seen yet uses the
	// object the agent read for it).
	Pod             *corev1.Pod
	UID             types.UID
	Namespace, Name string
	Redirection     enrollment.Redirection
	Reason          enrollment.Reason
	Repair          Repair
	Err             error // RepairFailed: why
}

// Dataplane is what the reconciler drives in the kernel (*dataplane.Dataplane).
type Dataplane interface {
	Enroll(ctx context.Context, pod dataplane.Pod) error
	Remove(ctx context.Context, uid string) error
	List() []inspect.EnrolledPod
}

// Ztunnel is the ZDS handoff (*zds.Server).
type Ztunnel interface {
	AddWorkload(ctx context.Context, w zds.Workload) error
	DelWorkload(ctx context.Context, uid string) error
}

// NetnsFinder finds running pods' netns (*podnetns.Finder).
type NetnsFinder interface {
	// Scan reads /proc once: the netns of every pod with a process on
	// this node. It ends early with ctx.
	Scan(ctx context.Context) (map[types.UID]podnetns.NetNS, error)
	// Current reports whether ns, found by an earlier Scan, still is pod
	// uid's.
	Current(uid types.UID, ns podnetns.NetNS) bool
	Same(a, b string) (same, known bool)
}

// Desired is what a source reports to (*Reconciler implements it).
type Desired interface {
	// SetPod reports the pod as it is now, with its namespace (nil when
	// unknown). It does not block.
	SetPod(pod *corev1.Pod, ns *corev1.Namespace)
	// DeletePod reports that no pod of this namespace and name exists.
	DeletePod(namespace, name string)
	// Synced reports that every pod that existed when the source started
	// has been reported; adopted pods none of them claims are removed then.
	Synced()
}

var _ Desired = (*Reconciler)(nil)

// Observer receives the reconciler's measurements (the agent's metrics);
// nil fields are skipped. None may block.
type Observer struct {
	Enrolled       func(d time.Duration) // a pod enrolled (CNI or live)
	Removing       func(uid string)      // a pod is about to leave the data path (its counters are still there)
	Removed        func(d time.Duration) // a pod left the data path
	DataplaneError func(op string)       // "enroll" or "remove" failed
	Members        func(n int)           // pods held now
	ZtunnelAck     func(a zds.Ack)       // every answer from ztunnel
}

// Config configures a Reconciler. Dataplane, Ztunnel and Netns are required.
type Config struct {
	Enrollment enrollment.Config
	Dataplane  Dataplane
	Ztunnel    Ztunnel
	Netns      NetnsFinder
	// RepairInPlace enrolls running ambient pods that are not redirected
	// (started before the agent, labelled later, state lost). Off, they
	// are reported as Unredirected for the status writer to act on.
	RepairInPlace bool
	// Takeover, when set, takes running pods over from istio-cni in place
	// before they are redirected (Takeover).
	Takeover Takeover
	// DrainRecheck is how often a draining takeover counts its flows
	// again (default DefaultDrainRecheck).
	DrainRecheck time.Duration
	// Workers is the number of reconcile workers (default 2).
	Workers int
	// RateLimiter spaces each pod's retries; default: exponential per pod
	// from 5 ms, doubling, capped at 30 s (istio-cni's requeue).
	RateLimiter workqueue.TypedRateLimiter[string]
	Logger      *slog.Logger
	Observer    Observer
}

// Retry bounds of the default rate limiter.
const (
	RetryBase = 5 * time.Millisecond
	RetryCap  = 30 * time.Second
)

// DefaultRateLimiter spaces each pod's retries: exponential per pod from
// RetryBase, doubling, capped at RetryCap, forgotten after a success.
func DefaultRateLimiter() workqueue.TypedRateLimiter[string] {
	return workqueue.NewTypedItemExponentialFailureRateLimiter[string](RetryBase, RetryCap)
}

// member is a pod the data path redirects, as the reconciler knows it.
type member struct {
	uid            string
	namespace      string
	name           string
	serviceAccount string
	netns          string // path; "" when not known (adopted, not found yet)
	containerID    string // the sandbox of the CNI ADD; "" for pods enrolled live or adopted
	iface          string
	ips            []netip.Addr
	opts           podopts.Options
	redirection    enrollment.Redirection
	// nacked: ztunnel refused the pod; the next reconcile sends it again.
	nacked bool
	// istioCNI: istio-cni's rules redirect the pod, not the data path (a
	// takeover refused it, or has not inspected it yet): it is handed to
	// ztunnel all the same, and its rules are never touched.
	istioCNI bool
	takeover takeoverStep
	note     string // why the pod is left on istio-cni
	// claimed: a source reported this pod, or it was adopted. Only a
	// claimed member leaves when its name has no pod (or another one): a
	// CNI ADD can come before the informers' first word of the pod, and
	// the delete of an older pod of the same name must not remove it.
	claimed bool
}

func (m *member) key() string { return m.namespace + "/" + m.name }

func (m *member) workload() zds.Workload {
	return zds.Workload{UID: m.uid, Name: m.name, Namespace: m.namespace, ServiceAccount: m.serviceAccount, Netns: m.netns}
}

type desired struct {
	pod *corev1.Pod
	ns  *corev1.Namespace
	// scan is the first scan of /proc that can find the pod's netns
	// (netnsScans): the next one when it was reported, or after a look-up
	// found none.
	scan uint64
}

// Reconciler owns the per-pod state. Create it with New, start it with Run.
type Reconciler struct {
	cfg   Config
	log   *slog.Logger
	queue workqueue.TypedRateLimitingInterface[string]
	netns *netnsScans

	synced   chan struct{}
	syncOnce sync.Once

	// startMu orders each pod's start with the stop: once Run logged
	// that it stops (stopping), no pod starts.
	startMu  sync.Mutex
	stopping bool

	keyMu sync.Mutex
	keys  map[string]*keyLock // serializes the CNI path with the workers, per pod

	mu      sync.Mutex
	members map[string]*member // by uid
	desired map[string]desired // by namespace/name
	// outside holds, by namespace/name, the uid of each pod last decided
	// not ambient: one that becomes ambient while running (its labels or
	// its namespace's changed) is enrolled live, as istio-cni does, not
	// repaired (no repair Event, never deleted or labelled by the repair
	// modes).
	outside   map[string]types.UID
	listeners []func(Change)
}

type keyLock struct {
	sync.Mutex
	users int
}

// New builds a reconciler; it does no I/O.
func New(cfg Config) (*Reconciler, error) {
	if cfg.Dataplane == nil || cfg.Ztunnel == nil || cfg.Netns == nil {
		return nil, errors.New("reconciler config: dataplane, ztunnel and netns finder are required")
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 2
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.DrainRecheck <= 0 {
		cfg.DrainRecheck = DefaultDrainRecheck
	}
	if cfg.RateLimiter == nil {
		cfg.RateLimiter = DefaultRateLimiter()
	}
	return &Reconciler{
		cfg: cfg, log: cfg.Logger,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(cfg.RateLimiter,
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "ambient-ebpf-pods"}),
		netns:   &netnsScans{finder: cfg.Netns},
		synced:  make(chan struct{}),
		keys:    map[string]*keyLock{},
		members: map[string]*member{},
		desired: map[string]desired{},
		outside: map[string]types.UID{},
	}, nil
}

// Subscribe adds a listener for Changes; call it before Run. Listeners are
// called in order, one Change at a time, while the reconciler holds its
// lock, so they see every pod's changes in the order they happened; they
// must not block or call the Reconciler.
func (r *Reconciler) Subscribe(f func(Change)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.listeners = append(r.listeners, f)
}

// publish tells the listeners c, with the pod's state as it is now (read
// under the same lock as ztunnel's acks write it, so a slower reconcile
// never publishes a state older than an ack's) and, when c has no pod
// object, the one its source last reported.
func (r *Reconciler) publish(c Change) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.publishLocked(c)
}

func (r *Reconciler) publishLocked(c Change) {
	c.Redirection = enrollment.RedirectionNone
	if mb := r.members[string(c.UID)]; mb != nil {
		c.Redirection = mb.redirection
	}
	if d, ok := r.desired[c.Namespace+"/"+c.Name]; ok && d.pod != nil && d.pod.UID == c.UID {
		c.Pod = d.pod
	}
	for _, f := range r.listeners {
		f(c)
	}
}

// decide is the one place that decides whether a pod belongs in the mesh,
// for every source: pkg/enrollment's rules with the node's settings.
func (r *Reconciler) decide(pod *corev1.Pod, ns *corev1.Namespace) enrollment.Decision {
	return enrollment.Decide(r.cfg.Enrollment, pod, ns)
}

// SetPod implements Desired.
func (r *Reconciler) SetPod(pod *corev1.Pod, ns *corev1.Namespace) {
	key := pod.Namespace + "/" + pod.Name
	scan := r.netns.next()
	r.mu.Lock()
	r.desired[key] = desired{pod: pod, ns: ns, scan: scan}
	r.mu.Unlock()
	r.queue.Add(key)
}

// DeletePod implements Desired.
func (r *Reconciler) DeletePod(namespace, name string) {
	key := namespace + "/" + name
	r.mu.Lock()
	delete(r.desired, key)
	r.mu.Unlock()
	r.queue.Add(key)
}

// Synced implements Desired.
func (r *Reconciler) Synced() { r.syncOnce.Do(func() { close(r.synced) }) }

// Run reconciles until ctx ends; the workers start once a source said
// Synced (or ctx ends first). When ctx ends no queued pod starts any more,
// and the pods being reconciled see ctx end (a scan of /proc stops with
// it), so Run returns in a bound whatever is queued: the pods left in the
// queue (Queued) are not lost, as the next start reconciles every pod the
// sources report and every pod the data path holds (Adopt). It returns
// after the workers have stopped.
func (r *Reconciler) Run(ctx context.Context) error {
	defer r.queue.ShutDown()
	select {
	case <-r.synced:
	case <-ctx.Done():
		return nil
	}
	var wg sync.WaitGroup
	for range r.cfg.Workers {
		wg.Go(func() {
			for r.processNext(ctx) {
			}
		})
	}
	<-ctx.Done()
	r.startMu.Lock()
	r.stopping = true
	r.log.Info("reconciler stopping: no queued pod starts from now on", "queued", r.queue.Len())
	r.startMu.Unlock()
	r.queue.ShutDown()
	wg.Wait()
	return nil
}

// Queued is the number of pods waiting in the queue (not those waiting
// out a retry's backoff).
func (r *Reconciler) Queued() int { return r.queue.Len() }

func (r *Reconciler) processNext(ctx context.Context) bool {
	if ctx.Err() != nil {
		return false // leave the next pod queued
	}
	key, quit := r.queue.Get()
	if quit {
		return false
	}
	defer r.queue.Done(key)
	if !r.start(ctx, key) {
		return false
	}
	if err := r.reconcile(ctx, key); err != nil {
		if ctx.Err() == nil {
			r.log.Warn("reconcile failed; retrying", "pod", key, "attempt", r.queue.NumRequeues(key)+1, "error", err)
			r.queue.AddRateLimited(key)
		}
		return true
	}
	r.queue.Forget(key)
	return true
}

// start says whether the pod with key may start now: not once ctx ended,
// even when a worker took it from the queue before the queue shut down.
func (r *Reconciler) start(ctx context.Context, key string) bool {
	r.startMu.Lock()
	defer r.startMu.Unlock()
	if r.stopping || ctx.Err() != nil {
		return false
	}
	r.log.Debug("reconciling pod", "pod", key)
	return true
}

// lockKey serializes everything done to one pod key: a worker and a CNI
// call about the same pod never interleave.
func (r *Reconciler) lockKey(key string) func() {
	r.keyMu.Lock()
	l := r.keys[key]
	if l == nil {
		l = &keyLock{}
		r.keys[key] = l
	}
	l.users++
	r.keyMu.Unlock()
	l.Lock()
	return func() {
		l.Unlock()
		r.keyMu.Lock()
		if l.users--; l.users == 0 {
			delete(r.keys, key)
		}
		r.keyMu.Unlock()
	}
}

// membersByKey returns copies of the members known under namespace/name
// (two when a pod and its replacement were both enrolled by CNI ADDs).
func (r *Reconciler) membersByKey(key string) []*member {
	namespace, name, _ := strings.Cut(key, "/")
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*member
	for _, mb := range r.members {
		if mb.namespace == namespace && mb.name == name {
			c := *mb
			out = append(out, &c)
		}
	}
	return out
}

func (r *Reconciler) member(uid string) *member {
	r.mu.Lock()
	defer r.mu.Unlock()
	if mb := r.members[uid]; mb != nil {
		c := *mb
		return &c
	}
	return nil
}

func (r *Reconciler) put(mb *member) {
	r.mu.Lock()
	r.members[mb.uid] = mb
	n := len(r.members)
	r.mu.Unlock()
	if f := r.cfg.Observer.Members; f != nil {
		f(n)
	}
}

func (r *Reconciler) forget(uid string) {
	r.mu.Lock()
	delete(r.members, uid)
	n := len(r.members)
	r.mu.Unlock()
	if f := r.cfg.Observer.Members; f != nil {
		f(n)
	}
}

// reconcile brings the pod with key namespace/name to its desired state.
func (r *Reconciler) reconcile(ctx context.Context, key string) error {
	unlock := r.lockKey(key)
	defer unlock()
	r.mu.Lock()
	d := r.desired[key]
	r.mu.Unlock()
	pod := d.pod
	if pod != nil {
		if err := validate.Pod(pod.Namespace, pod.Name, string(pod.UID)); err != nil {
			// Not retried: the object will not become valid. A pod known
			// under this key before still leaves below.
			r.log.Warn("pod skipped: invalid name or uid", "pod", key, "error", err)
			pod = nil
		}
	}
	// A pod that is gone, or replaced by a pod of the same name, leaves the
	// mesh under the UID it had.
	if pod != nil {
		r.update(string(pod.UID), func(m *member) { m.claimed = true })
	}
	for _, prev := range r.membersByKey(key) {
		if !prev.claimed || pod != nil && string(pod.UID) == prev.uid {
			continue
		}
		if err := r.remove(ctx, prev); err != nil {
			return fmt.Errorf("remove deleted pod %s (uid %s): %w", key, prev.uid, err)
		}
		r.log.Info("pod left the mesh", "pod", key, "uid", prev.uid, "reason", "deleted")
	}
	if pod == nil {
		r.mu.Lock()
		delete(r.outside, key)
		r.mu.Unlock()
		return nil
	}
	dec := r.decide(pod, d.ns)
	change := Change{Pod: pod, UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Reason: dec.Reason}
	mb := r.member(string(pod.UID))
	if !dec.Ambient {
		r.mu.Lock()
		r.outside[key] = pod.UID
		r.mu.Unlock()
		if mb != nil {
			if err := r.remove(ctx, mb); err != nil {
				return fmt.Errorf("remove pod %s: %w", key, err)
			}
			r.log.Info("pod left the mesh", "pod", key, "uid", pod.UID, "reason", dec.Reason)
		}
		r.publish(change)
		return nil
	}
	if mb == nil {
		r.mu.Lock()
		live := r.outside[key] == pod.UID
		r.mu.Unlock()
		return r.repair(ctx, pod, dec, change, live)
	}
	if mb.serviceAccount == "" && pod.Spec.ServiceAccountName != "" {
		mb.serviceAccount = pod.Spec.ServiceAccountName
		r.update(mb.uid, func(m *member) { m.serviceAccount = mb.serviceAccount })
	}
	if ips := podIPs(pod); len(mb.ips) == 0 && len(ips) > 0 {
		// Adopted without addresses (pins an agent before
		// dataplane.ErrDuplicateIP left): its source has them, and an
		// update of its options needs them.
		mb.ips = ips
		r.update(mb.uid, func(m *member) { m.ips = ips })
	}
	if mb.takeover != takeoverDone && r.cfg.Takeover != nil {
		if err := r.takeOver(ctx, mb); err != nil {
			r.publish(change)
			return err
		}
		mb = r.member(mb.uid)
		if mb == nil {
			r.publish(change)
			return nil
		}
	}
	if err := r.applyOptions(ctx, mb, dec.Options); err != nil {
		r.publish(change)
		return err
	}
	var zerr error
	if mb.nacked {
		zerr = r.handOver(ctx, mb)
	}
	r.publish(change)
	return zerr
}

// repair handles an ambient pod the data path does not redirect. live
// says the pod was outside the mesh and just became ambient: it is
// enrolled in place whatever the repair mode, and reported as a plain
// enrolment, not a repair.
func (r *Reconciler) repair(ctx context.Context, pod *corev1.Pod, dec enrollment.Decision, change Change, live bool) error {
	// Pods that have not started are the CNI plugin's: it redirects them
	// before their first instruction, and the status update that follows
	// brings them back here. Until then nothing redirects them.
	if pod.Status.Phase != corev1.PodRunning || pod.Status.PodIP == "" ||
		pod.DeletionTimestamp != nil || !RunsUnredirected(pod) {
		r.publish(change)
		return nil
	}
	if !r.cfg.RepairInPlace && !live {
		change.Repair = Unredirected
		r.publish(change)
		return nil
	}
	key := pod.Namespace + "/" + pod.Name
	var retry error
	ns, err := r.findNetns(ctx, key, pod.UID)
	if err == nil {
		mb := &member{uid: string(pod.UID), namespace: pod.Namespace, name: pod.Name,
			serviceAccount: pod.Spec.ServiceAccountName, netns: ns.Path, ips: podIPs(pod), opts: dec.Options, claimed: true}
		if err = r.planTakeover(ctx, mb); err == nil {
			retry, err = r.add(ctx, mb, false)
		}
		if err == nil && mb.takeover != takeoverDone {
			// Enrolled: istio-cni's state can go now (retried on failure).
			if terr := r.takeOver(ctx, mb); terr != nil {
				r.log.Warn("istio-cni takeover not finished; retrying", "pod", key, "error", terr)
				retry = errors.Join(retry, terr)
			}
		}
	} else {
		err = fmt.Errorf("find netns of pod %s: %w", key, err)
	}
	if err != nil && ctx.Err() != nil {
		// Stopping: not a failure to report; the next start repairs it.
		return fmt.Errorf("repair: add running pod %s to the mesh: %w", key, err)
	}
	if err != nil {
		// Retried; meanwhile istiod must not take the pod as captured.
		change.Repair, change.Err = RepairFailed, err
		r.publish(change)
		return fmt.Errorf("repair: add running pod %s to the mesh: %w", key, err)
	}
	if mb := r.member(string(pod.UID)); mb != nil && mb.istioCNI {
		r.log.Info("running pod left on istio-cni's rules, handed to ztunnel", "pod", key, "uid", pod.UID, "why", mb.note)
		r.publish(change)
		return retry
	}
	r.mu.Lock()
	delete(r.outside, key)
	r.mu.Unlock()
	if live {
		r.log.Info("redirected running pod in place: it became ambient", "pod", key, "uid", pod.UID, "reason", dec.Reason)
	} else {
		r.log.Info("repair: redirected running pod in place", "pod", key, "uid", pod.UID, "reason", dec.Reason)
		change.Repair = RepairedInPlace
	}
	r.publish(change)
	return retry
}

// applyOptions brings an enrolled pod's data path options (R12-R14) to
// opts in place: the data path's Enroll is idempotent and changes only
// what differs, so the pod keeps its links and its open connections.
func (r *Reconciler) applyOptions(ctx context.Context, mb *member, opts podopts.Options) error {
	if mb.opts.Equal(opts) || mb.istioCNI {
		// istio-cni's rules are not ours to change.
		return nil
	}
	key := mb.key()
	netns := mb.netns
	if netns == "" {
		ns, err := r.findNetns(ctx, key, types.UID(mb.uid))
		if err != nil {
			return fmt.Errorf("update options of pod %s: find netns: %w", key, err)
		}
		netns = ns.Path
	}
	p := dataplane.Pod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Netns: netns, Interface: mb.iface,
		IPs: mb.ips, Options: opts, Running: true}
	if err := r.enroll(ctx, p); err != nil {
		r.observeError("enroll")
		return fmt.Errorf("update options of pod %s: %w", key, err)
	}
	r.update(mb.uid, func(m *member) { m.opts, m.netns = opts, netns })
	r.log.Info("pod options updated in place", "pod", key, "uid", mb.uid, "from", mb.opts, "to", opts)
	mb.opts, mb.netns = opts, netns
	return nil
}

func (r *Reconciler) update(uid string, f func(*member)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if mb := r.members[uid]; mb != nil {
		f(mb)
	}
}

func (r *Reconciler) redirectionOf(uid string) enrollment.Redirection {
	r.mu.Lock()
	defer r.mu.Unlock()
	if mb := r.members[uid]; mb != nil {
		return mb.redirection
	}
	return enrollment.RedirectionNone
}

// Redirection reports the pod's redirection state.
func (r *Reconciler) Redirection(uid types.UID) enrollment.Redirection {
	return r.redirectionOf(string(uid))
}

// Pod is a member as the inspector and the hand-back see it.
type Pod struct {
	UID, Namespace, Name string
	Redirection          enrollment.Redirection
	Netns                string // "" when not known
	IPs                  []netip.Addr
	Options              podopts.Options
	// IstioCNI: istio-cni's rules redirect the pod, not the data path;
	// Note says why.
	IstioCNI bool
	Note     string
}

// Pods returns the pods the data path redirects, in no order.
func (r *Reconciler) Pods() []Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Pod, 0, len(r.members))
	for _, mb := range r.members {
		out = append(out, Pod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Redirection: mb.redirection,
			Netns: mb.netns, IPs: slices.Clone(mb.ips), Options: mb.opts, IstioCNI: mb.istioCNI, Note: mb.note})
	}
	return out
}

// Snapshot is what every new ztunnel connection receives (Z2,
// zds.Config.Snapshot).
func (r *Reconciler) Snapshot() []zds.Workload {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]zds.Workload, 0, len(r.members))
	for _, mb := range r.members {
		out = append(out, mb.workload())
	}
	return out
}

// add enrolls in the data path, then hands the pod to ztunnel. With no
// ztunnel connected the pod stays redirected and pending: ztunnel gets it
// in the snapshot of its connection, whose ack enables it. A NACK leaves it
// pending too, and comes back as retry, for the caller to schedule with the
// pod's backoff. strict (the CNI path) undoes the enrollment instead and
// fails with ztunnel's error.
func (r *Reconciler) add(ctx context.Context, mb *member, strict bool) (retry, err error) {
	start := time.Now()
	key := mb.key()
	if !mb.istioCNI {
		// Only the CNI path (strict) enrolls a pod before it runs.
		err = r.enroll(ctx, dataplane.Pod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Netns: mb.netns,
			Interface: mb.iface, IPs: mb.ips, Options: mb.opts, Running: !strict})
		if err != nil {
			r.observeError("enroll")
			return nil, fmt.Errorf("enroll pod %s in the dataplane: %w", key, err)
		}
	}
	mb.redirection = enrollment.RedirectionPending
	r.put(mb)
	zerr := r.cfg.Ztunnel.AddWorkload(ctx, mb.workload())
	switch {
	case zerr == nil:
		r.setRedirection(mb.uid, enrollment.RedirectionEnabled, false)
	case strict:
		r.forget(mb.uid)
		if rerr := r.cfg.Dataplane.Remove(context.WithoutCancel(ctx), mb.uid); rerr != nil {
			r.log.Error("undo enrollment failed", "pod", key, "error", rerr)
		}
		return nil, fmt.Errorf("hand pod %s to ztunnel: %w", key, zerr)
	case errors.Is(zerr, zds.ErrNoZtunnel):
		r.log.Warn("pod redirected, no ztunnel connected yet", "pod", key)
	default:
		r.setRedirection(mb.uid, enrollment.RedirectionPending, true)
		r.log.Warn("pod redirected, ztunnel did not take it", "pod", key, "error", zerr)
		retry = fmt.Errorf("hand pod %s to ztunnel: %w", key, zerr)
	}
	if f := r.cfg.Observer.Enrolled; f != nil {
		f(time.Since(start))
	}
	return retry, nil
}

// handOver sends a pending pod that ztunnel refused to ztunnel again.
func (r *Reconciler) handOver(ctx context.Context, mb *member) error {
	err := r.cfg.Ztunnel.AddWorkload(ctx, mb.workload())
	switch {
	case err == nil:
		r.setRedirection(mb.uid, enrollment.RedirectionEnabled, false)
		return nil
	case errors.Is(err, zds.ErrNoZtunnel):
		// The next connection's snapshot carries it.
		r.setRedirection(mb.uid, enrollment.RedirectionPending, false)
		return nil
	}
	r.setRedirection(mb.uid, enrollment.RedirectionPending, true)
	return fmt.Errorf("hand pod %s to ztunnel: %w", mb.key(), err)
}

func (r *Reconciler) setRedirection(uid string, s enrollment.Redirection, nacked bool) {
	r.update(uid, func(m *member) { m.redirection, m.nacked = s, nacked })
}

func (r *Reconciler) observeError(op string) {
	if f := r.cfg.Observer.DataplaneError; f != nil {
		f(op)
	}
}

// enroll checks what names the pod's pins and interfaces (pkg/validate),
// then enrolls it: the last check before a string from outside reaches a
// path. Every path into the data path goes through it.
func (r *Reconciler) enroll(ctx context.Context, p dataplane.Pod) error {
	checks := []error{validate.Pod(p.Namespace, p.Name, p.UID)}
	if p.Interface != "" {
		checks = append(checks, validate.Interface(p.Interface))
	}
	for _, v := range p.Options.RerouteInterfaces {
		if err := validate.Interface(v); err != nil {
			checks = append(checks, fmt.Errorf("annotation %s: %w", enrollment.RerouteInterfacesAnnotation, err))
		}
	}
	if err := errors.Join(checks...); err != nil {
		return err
	}
	return r.cfg.Dataplane.Enroll(ctx, p)
}

// remove takes the pod out of the data path and tells every ztunnel.
func (r *Reconciler) remove(ctx context.Context, mb *member) error {
	start := time.Now()
	r.forget(mb.uid)
	if r.cfg.Takeover != nil {
		r.cfg.Takeover.Forget(mb.uid)
	}
	if f := r.cfg.Observer.Removing; f != nil {
		f(mb.uid)
	}
	err := r.cfg.Dataplane.Remove(ctx, mb.uid)
	if err != nil {
		r.observeError("remove")
		err = fmt.Errorf("remove pod %s from the dataplane: %w", mb.key(), err)
	}
	if zerr := r.cfg.Ztunnel.DelWorkload(ctx, mb.uid); zerr != nil {
		// ztunnel drops pods missing from its next snapshot anyway.
		r.log.Warn("ztunnel did not take the removal", "pod", mb.key(), "error", zerr)
	}
	if f := r.cfg.Observer.Removed; f != nil {
		f(time.Since(start))
	}
	return err
}

// OnAck takes ztunnel's answer about a pod (zds.Config.OnAck): an ack of
// an Add or Keep turns a pending pod enabled and publishes it; a NACK of a
// snapshot entry leaves the pod pending and schedules a retry with the
// pod's backoff. (A live Add's NACK is retried by the reconcile that sent
// it, so its backoff counts each failure once.)
func (r *Reconciler) OnAck(a zds.Ack) {
	if f := r.cfg.Observer.ZtunnelAck; f != nil {
		f(a)
	}
	if a.Op == zds.OpDel {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	mb := r.members[a.UID]
	if mb == nil {
		return
	}
	key := mb.key()
	switch {
	case a.Err == nil && mb.redirection != enrollment.RedirectionEnabled:
		mb.redirection, mb.nacked = enrollment.RedirectionEnabled, false
		r.log.Info("ztunnel acked pod", "pod", key, "uid", a.UID, "snapshot", a.Snapshot)
		r.publishLocked(Change{UID: types.UID(mb.uid), Namespace: mb.namespace, Name: mb.name})
	case a.Err != nil:
		was := mb.redirection
		mb.redirection, mb.nacked = enrollment.RedirectionPending, true
		if a.Snapshot {
			r.log.Warn("ztunnel refused a snapshot entry; retrying", "pod", key, "error", a.Err)
			r.queue.AddRateLimited(key)
		}
		// The pod's status says so until ztunnel takes it: a ztunnel
		// that restarted and refused a pod it served no longer
		// serves it (its connections are refused, never let around).
		if was == enrollment.RedirectionEnabled {
			r.publishLocked(Change{UID: types.UID(mb.uid), Namespace: mb.namespace, Name: mb.name})
		}
	}
}

// RunsUnredirected reports whether the pod has a container that runs, or
// ran and failed, without redirection. A container whose current state is
// terminated with reason Completed or exit code 0 did its work and is never
// counted as broken, so a pod made only of those is left alone.
func RunsUnredirected(pod *corev1.Pod) bool {
	if len(pod.Status.ContainerStatuses) == 0 {
		return true
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if t := cs.State.Terminated; t != nil && (t.Reason == "Completed" || t.ExitCode == 0) {
			continue
		}
		return true
	}
	return false
}

func podIPs(pod *corev1.Pod) []netip.Addr {
	var ips []netip.Addr
	for _, p := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(p.IP); err == nil {
			ips = append(ips, a)
		}
	}
	if len(ips) == 0 {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			ips = append(ips, a)
		}
	}
	return ips
}
