// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
)

// countingFinder counts its scans of /proc. A scan finds the pods of
// running (at /proc/1/ns/net); with hold, it lasts until its context ends,
// as a scan of a large /proc outlasts a stop signal.
type countingFinder struct {
	fakeFinder
	hold bool

	mu        sync.Mutex
	scans     int
	cancelled int // scans that ended with their context
	running   map[types.UID]bool
	scanning  chan struct{} // closed when the first scan begins
}

func newCountingFinder(hold bool) *countingFinder {
	return &countingFinder{hold: hold, running: map[types.UID]bool{}, scanning: make(chan struct{})}
}

func (f *countingFinder) Scan(ctx context.Context) (map[types.UID]podnetns.NetNS, error) {
	f.mu.Lock()
	if f.scans++; f.scans == 1 {
		close(f.scanning)
	}
	f.mu.Unlock()
	if f.hold {
		<-ctx.Done()
	}
	if err := ctx.Err(); err != nil {
		f.mu.Lock()
		f.cancelled++
		f.mu.Unlock()
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[types.UID]podnetns.NetNS{}
	for uid := range f.running {
		out[uid] = podnetns.NetNS{Path: "/proc/1/ns/net", PID: 1}
	}
	return out, nil
}

func (f *countingFinder) start(uid types.UID) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.running[uid] = true
}

func (f *countingFinder) counts() (scans, cancelled int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.scans, f.cancelled
}

// messages records the messages logged, in order.
type messages struct {
	mu  sync.Mutex
	all []string
}

func (m *messages) Enabled(context.Context, slog.Level) bool { return true }
func (m *messages) WithAttrs([]slog.Attr) slog.Handler       { return m }
func (m *messages) WithGroup(string) slog.Handler            { return m }
func (m *messages) Handle(_ context.Context, r slog.Record) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.all = append(m.all, r.Message)
	return nil
}

// after counts the messages msg logged after the first first.
func (m *messages) after(first, msg string) (n int, found bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	i := slices.Index(m.all, first)
	if i < 0 {
		return 0, false
	}
	for _, s := range m.all[i+1:] {
		if s == msg {
			n++
		}
	}
	return n, true
}

// runningPods returns n running ambient pods of the namespace shop that
// the data path does not redirect yet: each needs its netns to be repaired.
func runningPods(n int) []*corev1.Pod {
	pods := make([]*corev1.Pod, n)
	for i := range pods {
		pods[i] = &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("app-%d", i), Namespace: "shop", UID: types.UID(fmt.Sprintf("uid-app-%d", i))},
			Status:     corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.10"},
		}
	}
	return pods
}

// Stopped with thousands of pods queued, the reconciler starts none of
// them: the two pods being reconciled when ctx ends are the last, their
// scan of /proc ends with ctx, and the rest stay queued for the next start
// (which reconciles every pod again). Before, every queued pod was still
// reconciled, each scanning /proc, after the stop signal.
func TestStopStartsNoQueuedPod(t *testing.T) {
	const queued = 5000
	finder := newCountingFinder(true)
	log := &messages{}
	e := newTestEnv(t, 1, func(c *Config) { c.Netns, c.Workers, c.Logger = finder, 2, slog.New(log) })
	for _, pod := range runningPods(queued) {
		e.r.SetPod(pod, e.ns["shop"])
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.r.Run(ctx) }()
	e.r.Synced()
	// Both workers took a pod: one scans, the other waits for that scan.
	<-finder.scanning
	testenv.Eventually(t, 10*time.Second, "both workers busy", func() bool { return e.r.Queued() == queued-2 })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	if n, ok := log.after("reconciler stopping: no queued pod starts from now on", "reconciling pod"); !ok || n != 0 {
		t.Errorf("%d pods started after the stop (stop logged: %v); want none", n, ok)
	}
	if scans, cancelled := finder.counts(); scans != 1 || cancelled != 1 {
		t.Errorf("%d scans of /proc, %d ended by the stop; want only the one under way when it came", scans, cancelled)
	}
	if got := e.r.Queued(); got != queued-2 {
		t.Errorf("%d pods left queued; want %d (all but the two under way)", got, queued-2)
	}
	for _, c := range e.chg.all {
		if c.Repair == RepairFailed {
			t.Errorf("the stop was published as a failed repair: %+v", c)
		}
	}
}

// A backlog of running pods to repair costs one scan of /proc, not one
// per pod (7 pods a second on a node of 8300 processes).
func TestRepairOfABacklogScansProcOnce(t *testing.T) {
	const backlog = 200
	finder := newCountingFinder(false)
	e := newTestEnv(t, 1, func(c *Config) { c.Netns = finder })
	pods := runningPods(backlog)
	for _, pod := range pods {
		finder.start(pod.UID)
		e.r.SetPod(pod, e.ns["shop"])
	}
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "every pod repaired", func() bool { return e.dp.count() == backlog })
	if scans, _ := finder.counts(); scans != 1 {
		t.Errorf("%d scans of /proc for %d pods; want 1", scans, backlog)
	}
}

// A pod whose process a scan did not find is looked for again by a newer
// scan on its retry, not answered from the one that missed it.
func TestPodNotFoundIsLookedForByANewerScan(t *testing.T) {
	finder := newCountingFinder(false)
	e := newTestEnv(t, 1, func(c *Config) { c.Netns = finder })
	pod := runningPods(1)[0]
	e.r.SetPod(pod, e.ns["shop"])
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "the repair failed", func() bool {
		c, ok := e.chg.last(pod.UID)
		return ok && c.Repair == RepairFailed
	})
	finder.start(pod.UID)
	testenv.Eventually(t, 10*time.Second, "the pod repaired on a retry", func() bool { return e.dp.has(string(pod.UID)) })
	if scans, _ := finder.counts(); scans < 2 {
		t.Errorf("%d scans; want the retry's own", scans)
	}
}
