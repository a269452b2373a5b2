// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// fakeTakeover answers Inspect with plan (or err, once), and reports
// draining for the first drains calls of Finish.
type fakeTakeover struct {
	mu         sync.Mutex
	plan       TakeoverPlan
	inspectErr error
	drains     int
	inspects   []TakeoverPod
	finishes   int
	enrolledAt []bool // whether the data path had the pod at each Finish
	dp         *fakeDataplane
	forgot     []string
}

func (f *fakeTakeover) Inspect(_ context.Context, p TakeoverPod) (TakeoverPlan, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.inspects = append(f.inspects, p)
	if err := f.inspectErr; err != nil {
		f.inspectErr = nil
		return TakeoverPlan{}, err
	}
	return f.plan, nil
}

func (f *fakeTakeover) Finish(_ context.Context, p TakeoverPod) (bool, error) {
	enrolled := f.dp.has(p.UID)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.finishes++
	f.enrolledAt = append(f.enrolledAt, enrolled)
	if f.drains > 0 {
		f.drains--
		return true, nil
	}
	return false, nil
}

func (f *fakeTakeover) Forget(uid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forgot = append(f.forgot, uid)
}

func (f *fakeTakeover) finished() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.finishes
}

func withTakeover(tk *fakeTakeover) func(*Config) {
	return func(c *Config) {
		c.Takeover = tk
		c.DrainRecheck = 10 * time.Millisecond
		tk.dp = c.Dataplane.(*fakeDataplane)
	}
}

// snapshotPod is web as istio-cni left it: running and annotated enabled.
func (e *testEnv) snapshotPod() *corev1.Pod {
	p := e.web.DeepCopy()
	p.Annotations = map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)}
	return p
}

func (e *testEnv) pod(uid string) (Pod, bool) {
	for _, p := range e.r.Pods() {
		if p.UID == uid {
			return p, true
		}
	}
	return Pod{}, false
}

// A pod istio-cni redirects is enrolled first and finished after: Finish
// only ever runs with the pod in the data path, again while it drains.
func TestTakeoverEnrolsFirstThenFinishesUntilDrained(t *testing.T) {
	tk := &fakeTakeover{plan: TakeoverPlan{Action: TakeoverProceed}, drains: 2}
	e := newTestEnv(t, 1, withTakeover(tk))
	pod := e.snapshotPod()
	e.r.Adopt(context.Background(), []*corev1.Pod{pod})
	if e.dp.has("uid-web") {
		t.Fatal("adopted before it was inspected")
	}
	if p, ok := e.pod("uid-web"); !ok || !p.IstioCNI || p.Redirection != enrollment.RedirectionEnabled {
		t.Fatalf("before the inspection: %+v %v, want a member istio-cni redirects, enabled", p, ok)
	}
	e.r.SetPod(pod, e.ns["shop"])
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "three Finish calls (two draining)", func() bool { return tk.finished() == 3 })
	if !e.dp.has("uid-web") {
		t.Fatal("not enrolled after the takeover")
	}
	tk.mu.Lock()
	defer tk.mu.Unlock()
	for i, enrolled := range tk.enrolledAt {
		if !enrolled {
			t.Errorf("Finish %d ran before the pod was enrolled", i)
		}
	}
	if len(tk.inspects) != 1 || tk.inspects[0].Pinned || tk.inspects[0].Netns == "" {
		t.Errorf("inspections %+v, want one of an unpinned pod with its netns", tk.inspects)
	}
	if p, _ := e.pod("uid-web"); p.IstioCNI {
		t.Errorf("still marked istio-cni's: %+v", p)
	}
}

// A refused pod is never enrolled, yet ztunnel has it and it stays
// enabled; its options are not applied to istio-cni's rules.
func TestTakeoverRefusedLeavesThePodOnIstioCNI(t *testing.T) {
	tk := &fakeTakeover{plan: TakeoverPlan{Action: TakeoverRefused, Reason: "hand-edited"}}
	e := newTestEnv(t, 1, withTakeover(tk))
	pod := e.snapshotPod()
	e.r.Adopt(context.Background(), []*corev1.Pod{pod})
	e.r.SetPod(pod, e.ns["shop"])
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "the inspection", func() bool {
		p, _ := e.pod("uid-web")
		return p.Note == "hand-edited"
	})
	p, _ := e.pod("uid-web")
	if !p.IstioCNI || p.Redirection != enrollment.RedirectionEnabled || e.dp.has("uid-web") || tk.finished() != 0 {
		t.Fatalf("pod %+v, enrolled %v, finishes %d: want left on istio-cni, enabled, not enrolled", p, e.dp.has("uid-web"), tk.finished())
	}
	if ws := e.r.Snapshot(); len(ws) != 1 || ws[0].UID != "uid-web" {
		t.Errorf("ztunnel's snapshot %+v, want the pod", ws)
	}
	// An option change is not ours to make on istio-cni's rules.
	ns := e.ns["shop"].DeepCopy()
	pod = pod.DeepCopy()
	pod.Annotations[enrollment.DNSCaptureAnnotation] = "false"
	e.r.SetPod(pod, ns)
	time.Sleep(50 * time.Millisecond)
	if len(e.dp.enrolls) != 0 {
		t.Errorf("enrolled %+v", e.dp.enrolls)
	}
	// It leaves like any pod.
	e.r.DeletePod("shop", "web")
	testenv.Eventually(t, 10*time.Second, "the pod left", func() bool { _, ok := e.pod("uid-web"); return !ok })
}

// A failed inspection is retried; meanwhile the pod stays as istio-cni
// left it (handed to ztunnel, not enrolled).
func TestTakeoverInspectFailureIsRetried(t *testing.T) {
	tk := &fakeTakeover{plan: TakeoverPlan{Action: TakeoverProceed}, inspectErr: errors.New("iptables-save: exit status 1")}
	e := newTestEnv(t, 1, withTakeover(tk))
	pod := e.snapshotPod()
	e.r.Adopt(context.Background(), []*corev1.Pod{pod})
	e.r.SetPod(pod, e.ns["shop"])
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "the takeover after the retry", func() bool { return tk.finished() == 1 })
	if !e.dp.has("uid-web") {
		t.Error("not enrolled")
	}
}

// A pod pinned before the restart is re-enrolled in place at once and
// inspected as pinned (cheaply: a takeover cut short finishes).
func TestTakeoverOfAPinnedPodIsInspectedAsPinned(t *testing.T) {
	tk := &fakeTakeover{plan: TakeoverPlan{Action: TakeoverNone}}
	e := newTestEnv(t, 1, withTakeover(tk))
	e.dp.pinned = []inspect.EnrolledPod{{UID: "uid-web", Namespace: "shop", Name: "web", Interface: "eth0"}}
	pod := e.snapshotPod()
	e.r.Adopt(context.Background(), []*corev1.Pod{pod})
	if !e.dp.has("uid-web") {
		t.Fatal("a pinned pod was not re-enrolled in place by Adopt")
	}
	e.r.SetPod(pod, e.ns["shop"])
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "the inspection", func() bool {
		tk.mu.Lock()
		defer tk.mu.Unlock()
		return len(tk.inspects) == 1
	})
	if !tk.inspects[0].Pinned {
		t.Errorf("inspected %+v, want pinned", tk.inspects[0])
	}
}

// A running pod found unredirected is inspected before it is repaired.
func TestTakeoverOnRepair(t *testing.T) {
	tk := &fakeTakeover{plan: TakeoverPlan{Action: TakeoverProceed}}
	e := newTestEnv(t, 1, withTakeover(tk))
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	if !e.dp.has("uid-web") || tk.finished() != 1 {
		t.Fatalf("enrolled %v, finishes %d", e.dp.has("uid-web"), tk.finished())
	}
	tk.plan = TakeoverPlan{Action: TakeoverRefused, Reason: "older layout"}
	job := e.web.DeepCopy()
	job.Name, job.UID = "web2", "uid-web2"
	if err := e.liveAdd(t, job); err != nil {
		t.Fatal(err)
	}
	if p, ok := e.pod("uid-web2"); !ok || !p.IstioCNI || e.dp.has("uid-web2") || e.zt.addedCount() != 2 {
		t.Errorf("refused repair: %+v %v, enrolled %v, ztunnel %v", p, ok, e.dp.has("uid-web2"), e.zt.added)
	}
}
