// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package reconcilertest runs the real reconciler over recording fakes of
// the data path, ztunnel and the netns finder, for tests of the sources,
// the status writer and the code that wires them.
package reconcilertest

import (
	"context"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// Op names a data path call.
type Op string

const (
	OpAdd    Op = "add"
	OpRemove Op = "remove"
)

// Call is one recorded enrollment or removal the reconciler made on its
// own (live enrollment, repair, option updates, removals); the
// enrollments of CNI ADDs are not calls.
type Call struct {
	Op   Op
	Pod  string // namespace/name
	UID  types.UID
	Opts podopts.Options
}

// Mesh is the reconciler over fakes. It is a reconciler.Desired, so
// sources report to it directly. Safe for concurrent use.
type Mesh struct {
	mu      sync.Mutex
	calls   []Call
	adopted map[types.UID]bool
	// reported: every pod UID SetPod carried, which fakeNetns finds.
	reported map[types.UID]bool
	// pending makes ztunnel's AddWorkload find no ztunnel, leaving pods
	// pending until Ack.
	pending bool
	addErr  error
	rec     *reconciler.Reconciler
}

var _ reconciler.Desired = (*Mesh)(nil)

// NewMesh returns fakes whose AddWorkload enables pods at once; Start
// runs the reconciler over them.
func NewMesh() *Mesh { return &Mesh{adopted: map[types.UID]bool{}, reported: map[types.UID]bool{}} }

// Start builds the reconciler over the fakes with cfg (its Dataplane,
// Ztunnel and Netns are the fakes; its Enrollment defaults to
// enrollment.DefaultConfig) and runs it until the test ends.
func (m *Mesh) Start(t testing.TB, cfg reconciler.Config) *reconciler.Reconciler {
	t.Helper()
	cfg.Dataplane, cfg.Ztunnel, cfg.Netns = fakeDataplane{m}, fakeZtunnel{m}, fakeNetns{m}
	if cfg.Enrollment.ZtunnelLabels == nil {
		cfg.Enrollment = enrollment.DefaultConfig()
	}
	rec, err := reconciler.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	m.mu.Lock()
	m.rec = rec
	m.mu.Unlock()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- rec.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("reconciler run: %v", err)
		}
	})
	return rec
}

// Reconciler returns the reconciler Start built.
func (m *Mesh) Reconciler() *reconciler.Reconciler {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rec
}

// SetPod, DeletePod and Synced make the Mesh a reconciler.Desired.
func (m *Mesh) SetPod(pod *corev1.Pod, ns *corev1.Namespace) {
	m.mu.Lock()
	m.reported[pod.UID] = true
	m.mu.Unlock()
	m.Reconciler().SetPod(pod, ns)
}
func (m *Mesh) DeletePod(namespace, name string) { m.Reconciler().DeletePod(namespace, name) }
func (m *Mesh) Synced()                          { m.Reconciler().Synced() }

// SetPending makes later hand-overs find no ztunnel, so pods stay pending
// until Ack.
func (m *Mesh) SetPending(pending bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pending = pending
}

// FailAdd makes the data path's Enroll return err (nil to succeed again).
func (m *Mesh) FailAdd(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.addErr = err
}

// Ack is ztunnel acknowledging the pod, as its snapshot ack would.
func (m *Mesh) Ack(uid types.UID) {
	m.Reconciler().OnAck(zds.Ack{Conn: 1, UID: string(uid), Op: zds.OpAdd, Snapshot: true})
}

// Adopt marks a pod's data path state as surviving a restart (pinned,
// with the default options); call it before the reconciler's Adopt.
func (m *Mesh) Adopt(uid types.UID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.adopted[uid] = true
}

// Redirection reports the pod's state in the reconciler.
func (m *Mesh) Redirection(uid types.UID) enrollment.Redirection {
	return m.Reconciler().Redirection(uid)
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

type fakeDataplane struct{ m *Mesh }

func (f fakeDataplane) Enroll(_ context.Context, p dataplane.Pod) error {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	if p.Interface == "" { // a CNI ADD names the interface; live enrollment does not
		f.m.calls = append(f.m.calls, Call{Op: OpAdd, Pod: p.Namespace + "/" + p.Name, UID: types.UID(p.UID),
			Opts: p.Options})
	}
	return f.m.addErr
}

func (f fakeDataplane) Remove(_ context.Context, uid string) error {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	f.m.calls = append(f.m.calls, Call{Op: OpRemove, UID: types.UID(uid)})
	delete(f.m.adopted, types.UID(uid))
	return nil
}

func (f fakeDataplane) List() []inspect.EnrolledPod {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	var out []inspect.EnrolledPod
	for uid := range f.m.adopted {
		out = append(out, inspect.EnrolledPod{UID: string(uid), Options: podopts.Options{DNSCapture: true}})
	}
	return out
}

type fakeZtunnel struct{ m *Mesh }

func (f fakeZtunnel) AddWorkload(context.Context, zds.Workload) error {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	if f.m.pending {
		return zds.ErrNoZtunnel
	}
	return nil
}

func (fakeZtunnel) DelWorkload(context.Context, string) error { return nil }

// fakeNetns finds the netns of every pod reported through the Mesh at
// /proc/1/ns/net; the start-up scan, before the sources report, finds
// none (the tests' adoption is Adopt).
type fakeNetns struct{ m *Mesh }

func (f fakeNetns) Scan(context.Context) (map[types.UID]podnetns.NetNS, error) {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	out := map[types.UID]podnetns.NetNS{}
	for uid := range f.m.reported {
		out[uid] = podnetns.NetNS{Path: "/proc/1/ns/net", PID: 1}
	}
	return out, nil
}

func (fakeNetns) Current(types.UID, podnetns.NetNS) bool { return true }

func (fakeNetns) Same(a, b string) (same, known bool) { return a == b, a == b }
