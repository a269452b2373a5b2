// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

type fakeDataplane struct {
	mu       sync.Mutex
	enrolled map[string]dataplane.Pod
	enrolls  []dataplane.Pod
	removes  int
	fail     error
	pinned   []inspect.EnrolledPod // what List reports (a restart's pins)
}

func (f *fakeDataplane) Enroll(_ context.Context, p dataplane.Pod) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.enrolls = append(f.enrolls, p)
	if f.fail != nil {
		return f.fail
	}
	f.enrolled[p.UID] = p
	return nil
}

func (f *fakeDataplane) Remove(_ context.Context, uid string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removes++
	delete(f.enrolled, uid)
	return nil
}

func (f *fakeDataplane) List() []inspect.EnrolledPod { return f.pinned }

func (f *fakeDataplane) has(uid string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.enrolled[uid]
	return ok
}

func (f *fakeDataplane) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.enrolled)
}

// fakeZtunnel answers as the ZDS server does: an Ack event for each
// answer, before the call returns.
type fakeZtunnel struct {
	mu    sync.Mutex
	conns int
	added []string
	nacks int // the next nacks Adds are refused
	onAck func(zds.Ack)
}

func (f *fakeZtunnel) AddWorkload(_ context.Context, w zds.Workload) error {
	f.mu.Lock()
	if f.conns == 0 {
		f.mu.Unlock()
		return zds.ErrNoZtunnel
	}
	var err error
	if f.nacks > 0 {
		f.nacks--
		err = fmt.Errorf("add workload %s: %w: netns gone", w.UID, zds.ErrNack)
	} else {
		f.added = append(f.added, w.UID)
	}
	onAck := f.onAck
	f.mu.Unlock()
	if onAck != nil {
		onAck(zds.Ack{Conn: 1, UID: w.UID, Op: zds.OpAdd, Err: err})
	}
	return err
}

func (f *fakeZtunnel) DelWorkload(context.Context, string) error { return nil }

func (f *fakeZtunnel) addedCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.added)
}

// fakeFinder finds the netns of each of the tests' pods at
// /proc/1/ns/net. Different netns paths are of unknown sameness, unless
// distinct says they are different namespaces.
type fakeFinder struct{ distinct bool }

func (fakeFinder) Scan(context.Context) (map[types.UID]podnetns.NetNS, error) {
	out := map[types.UID]podnetns.NetNS{}
	for _, uid := range []types.UID{"uid-web", "uid-web2", "uid-web-2", "uid-job", "uid-db", "uid-lost", "uid-fine"} {
		out[uid] = podnetns.NetNS{Path: "/proc/1/ns/net", PID: 1}
	}
	return out, nil
}

func (fakeFinder) Current(types.UID, podnetns.NetNS) bool { return true }

func (f fakeFinder) Same(a, b string) (same, known bool) {
	if a == b {
		return true, true
	}
	return false, f.distinct
}

// changes records what the reconciler publishes.
type changes struct {
	mu  sync.Mutex
	all []Change
}

func (c *changes) observe(ch Change) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.all = append(c.all, ch)
}

func (c *changes) last(uid types.UID) (Change, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.all) - 1; i >= 0; i-- {
		if c.all[i].UID == uid {
			return c.all[i], true
		}
	}
	return Change{}, false
}

type testEnv struct {
	r   *Reconciler
	dp  *fakeDataplane
	zt  *fakeZtunnel
	chg *changes
	web *corev1.Pod
	job *corev1.Pod
	ns  map[string]*corev1.Namespace
}

func newTestEnv(t *testing.T, conns int, opts ...func(*Config)) *testEnv {
	t.Helper()
	e := &testEnv{dp: &fakeDataplane{enrolled: map[string]dataplane.Pod{}}, zt: &fakeZtunnel{conns: conns}, chg: &changes{}}
	e.web = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", UID: "uid-web"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.10"}}
	e.job = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "job", Namespace: "legacy", UID: "uid-job"}}
	e.ns = map[string]*corev1.Namespace{
		"shop": {ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}},
	}
	cfg := Config{Enrollment: enrollment.DefaultConfig(), Dataplane: e.dp, Ztunnel: e.zt, Netns: fakeFinder{},
		RepairInPlace: true, Logger: slog.New(slog.DiscardHandler)}
	for _, o := range opts {
		o(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.r = r
	e.zt.onAck = r.OnAck
	r.Subscribe(e.chg.observe)
	return e
}

// run starts the workers (the sources synced) until the test ends.
func (e *testEnv) run(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.r.Run(ctx) }()
	e.r.Synced()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

func addReq(pod *corev1.Pod, ns *corev1.Namespace, uid string) CNIAdd {
	return CNIAdd{Pod: pod, Namespace: ns, UID: uid, Netns: "/run/netns/x", Interface: "eth0", IPs: []netip.Addr{netip.MustParseAddr("198.18.0.10")}}
}

// liveAdd reconciles a running pod the data path does not hold, as the
// informers report it.
func (e *testEnv) liveAdd(t *testing.T, pod *corev1.Pod) error {
	t.Helper()
	e.r.SetPod(pod, e.ns[pod.Namespace])
	return e.r.reconcile(context.Background(), pod.Namespace+"/"+pod.Name)
}

func TestCNIAddEnrollsAmbientPodsAndPublishesThem(t *testing.T) {
	e := newTestEnv(t, 1)
	res, err := e.r.CNIAdd(context.Background(), addReq(e.web, e.ns["shop"], "uid-web"))
	if err != nil || !res.Enrolled {
		t.Fatalf("CNIAdd = %+v, %v", res, err)
	}
	if !e.dp.has("uid-web") || e.zt.addedCount() != 1 {
		t.Errorf("dataplane %v, ztunnel %v", e.dp.enrolled, e.zt.added)
	}
	if c, ok := e.chg.last("uid-web"); e.r.Redirection("uid-web") != enrollment.RedirectionEnabled || !ok || c.Redirection != enrollment.RedirectionEnabled {
		t.Errorf("state %q, published %+v", e.r.Redirection("uid-web"), c)
	}
}

func TestCNIAddLeavesNonAmbientPodsAlone(t *testing.T) {
	e := newTestEnv(t, 1)
	res, err := e.r.CNIAdd(context.Background(), addReq(e.job, nil, "uid-job"))
	if err != nil || res.Enrolled || e.dp.count() != 0 {
		t.Fatalf("CNIAdd = %+v, %v; dataplane %v", res, err, e.dp.enrolled)
	}
}

// Fail closed: without ztunnel the ADD fails, says why, and leaves nothing.
func TestCNIAddFailsClosedWithoutZtunnel(t *testing.T) {
	e := newTestEnv(t, 0)
	_, err := e.r.CNIAdd(context.Background(), addReq(e.web, e.ns["shop"], "uid-web"))
	if !errors.Is(err, zds.ErrNoZtunnel) {
		t.Fatalf("CNIAdd error = %v, want ErrNoZtunnel", err)
	}
	if e.dp.count() != 0 || len(e.r.Pods()) != 0 {
		t.Errorf("state left after a failed ADD: dataplane %v, members %d", e.dp.enrolled, len(e.r.Pods()))
	}
}

func TestCNIAddFailsOnDataplaneErrorAndUIDMismatch(t *testing.T) {
	e := newTestEnv(t, 1)
	e.dp.fail = errors.New("attach failed")
	if _, err := e.r.CNIAdd(context.Background(), addReq(e.web, e.ns["shop"], "uid-web")); err == nil {
		t.Error("CNIAdd succeeded although the dataplane failed")
	}
	e.dp.fail = nil
	if _, err := e.r.CNIAdd(context.Background(), addReq(e.web, e.ns["shop"], "other-uid")); err == nil {
		t.Error("CNIAdd succeeded for a UID the API does not know")
	}
}

// Live enrollment without ztunnel: redirected and pending; enabled by the
// ack of the snapshot entry ztunnel's connection gets, with no poll and no
// second Add.
func TestPendingPodTurnsEnabledOnItsSnapshotAck(t *testing.T) {
	e := newTestEnv(t, 0)
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	if got := e.r.Redirection(e.web.UID); got != enrollment.RedirectionPending {
		t.Fatalf("state %q, want pending", got)
	}
	if snap := e.r.Snapshot(); len(snap) != 1 || snap[0].UID != "uid-web" {
		t.Fatalf("snapshot %v", snap)
	}
	e.r.OnAck(zds.Ack{Conn: 1, UID: "uid-web", Op: zds.OpAdd, Snapshot: true})
	if got := e.r.Redirection(e.web.UID); got != enrollment.RedirectionEnabled {
		t.Errorf("state %q after the snapshot ack, want enabled", got)
	}
	if c, ok := e.chg.last(e.web.UID); !ok || c.Redirection != enrollment.RedirectionEnabled || c.Pod == nil {
		t.Errorf("published %+v; want enabled with the pod", c)
	}
	if n := e.zt.addedCount(); n != 0 {
		t.Errorf("ztunnel got %d live Adds; want none (the snapshot carried the pod)", n)
	}
}

// recordingLimiter is the default rate limiter, recording each delay.
type recordingLimiter struct {
	workqueue.TypedRateLimiter[string]
	mu     sync.Mutex
	delays map[string][]time.Duration
}

func (l *recordingLimiter) When(key string) time.Duration {
	d := l.TypedRateLimiter.When(key)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.delays[key] = append(l.delays[key], d)
	return d
}

func (l *recordingLimiter) of(key string) []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.delays[key])
}

// A NACKed live Add is retried with the pod's exponential backoff, from
// 5 ms doubling, until ztunnel takes it; the pod stays pending meanwhile.
func TestNACKedAddIsRetriedWithExponentialBackoff(t *testing.T) {
	rl := &recordingLimiter{TypedRateLimiter: DefaultRateLimiter(), delays: map[string][]time.Duration{}}
	e := newTestEnv(t, 1, func(c *Config) { c.RateLimiter = rl })
	e.zt.nacks = 4
	e.run(t)
	e.r.SetPod(e.web, e.ns["shop"])
	testenv.Eventually(t, 10*time.Second, "pod enabled once ztunnel takes it", func() bool { return e.r.Redirection(e.web.UID) == enrollment.RedirectionEnabled })
	want := []time.Duration{5 * time.Millisecond, 10 * time.Millisecond, 20 * time.Millisecond, 40 * time.Millisecond}
	if got := rl.of("shop/web"); !slices.Equal(got, want) {
		t.Errorf("retry delays %v; want %v", got, want)
	}
	if e.zt.addedCount() != 1 || e.dp.count() != 1 {
		t.Errorf("ztunnel took %d Adds, dataplane holds %d pods; want 1 and 1", e.zt.addedCount(), e.dp.count())
	}
	// The backoff is per pod and starts again after a success.
	e.zt.mu.Lock()
	e.zt.nacks = 1
	e.zt.mu.Unlock()
	other := e.web.DeepCopy()
	other.Name, other.UID = "db", "uid-db"
	e.r.SetPod(other, e.ns["shop"])
	testenv.Eventually(t, 10*time.Second, "second pod enabled", func() bool { return e.r.Redirection(other.UID) == enrollment.RedirectionEnabled })
	if got := rl.of("shop/db"); !slices.Equal(got, want[:1]) {
		t.Errorf("second pod's retry delays %v; want %v", got, want[:1])
	}
}

// The backoff is capped.
func TestDefaultBackoffIsCapped(t *testing.T) {
	rl := DefaultRateLimiter()
	var last time.Duration
	for range 30 {
		last = rl.When("shop/web")
	}
	if last != RetryCap {
		t.Errorf("delay after 30 failures %v; want the cap %v", last, RetryCap)
	}
}

// A NACK of a snapshot entry leaves the pod pending and schedules a retry,
// which the live Add that follows ends.
func TestNACKedSnapshotEntryIsRetried(t *testing.T) {
	e := newTestEnv(t, 1)
	e.zt.conns = 0
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	e.zt.mu.Lock()
	e.zt.conns = 1
	e.zt.mu.Unlock()
	e.run(t)
	e.r.OnAck(zds.Ack{Conn: 1, UID: "uid-web", Op: zds.OpAdd, Snapshot: true, Err: fmt.Errorf("%w: busy", zds.ErrNack)})
	testenv.Eventually(t, 10*time.Second, "pod enabled by the retry", func() bool { return e.r.Redirection(e.web.UID) == enrollment.RedirectionEnabled })
	if e.zt.addedCount() != 1 {
		t.Errorf("ztunnel took %d live Adds; want 1", e.zt.addedCount())
	}
}

// A restarted ztunnel that refuses a pod it served (a NACK of its snapshot
// entry) no longer serves it: the pod's status goes pending (published, so
// its annotation says so) until the retry's ack enables it again.
func TestNACKOfAnEnabledPodPublishesPending(t *testing.T) {
	e := newTestEnv(t, 1)
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	e.run(t)
	testenv.Eventually(t, 10*time.Second, "pod enabled", func() bool { return e.r.Redirection(e.web.UID) == enrollment.RedirectionEnabled })
	e.chg.mu.Lock()
	seen := len(e.chg.all)
	e.chg.mu.Unlock()
	e.r.OnAck(zds.Ack{Conn: 2, UID: "uid-web", Op: zds.OpAdd, Snapshot: true, Err: fmt.Errorf("%w: busy", zds.ErrNack)})
	testenv.Eventually(t, 10*time.Second, "pod enabled by the retry", func() bool { return e.r.Redirection(e.web.UID) == enrollment.RedirectionEnabled })
	e.chg.mu.Lock()
	var after []enrollment.Redirection
	for _, c := range e.chg.all[seen:] {
		if c.UID == e.web.UID {
			after = append(after, c.Redirection)
		}
	}
	e.chg.mu.Unlock()
	if len(after) < 2 || after[0] != enrollment.RedirectionPending || after[len(after)-1] != enrollment.RedirectionEnabled {
		t.Errorf("published after the NACK: %v; want pending, then enabled", after)
	}
}

// Changing a pod's options on a running enrolled pod updates its data path
// in place: one Enroll with the new options, no removal, the pod stays
// enabled.
func TestOptionChangesAreAppliedInPlace(t *testing.T) {
	e := newTestEnv(t, 1)
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		annotations map[string]string
		want        podopts.Options
	}{
		{map[string]string{enrollment.BypassInboundAnnotation: "true"}, podopts.Options{BypassInbound: true, DNSCapture: true}},
		{map[string]string{enrollment.DNSCaptureAnnotation: "false"}, podopts.Options{}},
		{map[string]string{enrollment.RerouteInterfacesAnnotation: "tun0, wg0"}, podopts.Options{DNSCapture: true, RerouteInterfaces: []string{"tun0", "wg0"}}},
		{nil, podopts.Options{DNSCapture: true}},
	}
	for i, s := range steps {
		p := e.web.DeepCopy()
		p.Annotations = s.annotations
		before := len(e.dp.enrolls)
		if err := e.liveAdd(t, p); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if n := len(e.dp.enrolls) - before; n != 1 {
			t.Fatalf("step %d: %d Enroll calls; want 1", i, n)
		}
		got := e.dp.enrolls[len(e.dp.enrolls)-1]
		if got.Options.BypassInbound != s.want.BypassInbound || got.Options.DNSCapture != s.want.DNSCapture ||
			!slices.Equal(got.Options.RerouteInterfaces, s.want.RerouteInterfaces) || got.Netns != "/proc/1/ns/net" {
			t.Errorf("step %d: Enroll(%+v); want options %+v in the pod's netns", i, got, s.want)
		}
	}
	if e.dp.removes != 0 || e.r.Redirection(e.web.UID) != enrollment.RedirectionEnabled || e.zt.addedCount() != 1 {
		t.Errorf("removes %d, state %q, ztunnel Adds %d; want 0, enabled, 1", e.dp.removes, e.r.Redirection(e.web.UID), e.zt.addedCount())
	}
	// Unchanged options touch nothing.
	before := len(e.dp.enrolls)
	if err := e.liveAdd(t, e.web); err != nil || len(e.dp.enrolls) != before {
		t.Errorf("reconcile without a change: %v, %d Enroll calls", err, len(e.dp.enrolls)-before)
	}
}

func delReq(p CNIDel) CNIDel { return p }

// A DEL without K8S_POD_UID finds the pod the CNI ADD enrolled by its
// sandbox, its netns or its names, as the runtime gives them.
func TestCNIDelWithoutUIDFindsTheEnrolledPod(t *testing.T) {
	cases := map[string]CNIDel{
		"names":           {Namespace: "shop", Name: "web"},
		"names and more":  {Namespace: "shop", Name: "web", ContainerID: "sandbox-web", Netns: "/run/netns/x"},
		"container id":    {ContainerID: "sandbox-web"},
		"netns":           {Netns: "/run/netns/x"},
		"names and netns": {Namespace: "shop", Name: "web", Netns: "/run/netns/x"},
	}
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			e := newTestEnv(t, 1)
			add := addReq(e.web, e.ns["shop"], "uid-web")
			add.ContainerID = "sandbox-web"
			if _, err := e.r.CNIAdd(context.Background(), add); err != nil {
				t.Fatal(err)
			}
			if err := e.r.CNIDel(context.Background(), delReq(p)); err != nil {
				t.Fatal(err)
			}
			if e.dp.count() != 0 || e.r.Redirection("uid-web") != enrollment.RedirectionNone {
				t.Errorf("pod still enrolled after DEL %v: dataplane %v", p, e.dp.enrolled)
			}
		})
	}
}

// A pod enrolled live or adopted has no sandbox on record and a /proc netns
// path: its names find it.
func TestCNIDelWithoutUIDFindsALiveEnrolledPodByName(t *testing.T) {
	e := newTestEnv(t, 1)
	if err := e.liveAdd(t, e.web); err != nil {
		t.Fatal(err)
	}
	if err := e.r.CNIDel(context.Background(), CNIDel{Namespace: "shop", Name: "web", ContainerID: "c9", Netns: "/run/netns/x"}); err != nil {
		t.Fatal(err)
	}
	if e.dp.count() != 0 {
		t.Errorf("pod still enrolled: %v", e.dp.enrolled)
	}
}

// Removing pod A never removes pod B: a DEL about another sandbox, another
// netns, or a name two members share removes nothing.
func TestCNIDelNeverRemovesAnotherPod(t *testing.T) {
	cases := []struct {
		name     string
		distinct bool
		del      CNIDel
	}{
		{"older sandbox of the same uid", false, CNIDel{Namespace: "shop", Name: "web", UID: "uid-web", ContainerID: "sandbox-old"}},
		{"older sandbox, no uid", false, CNIDel{Namespace: "shop", Name: "web", ContainerID: "sandbox-old"}},
		{"another netns, no uid", true, CNIDel{Namespace: "shop", Name: "web", Netns: "/run/netns/old"}},
		{"another pod's names", false, CNIDel{Namespace: "shop", Name: "db"}},
		{"nothing in common", false, CNIDel{ContainerID: "c2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newTestEnv(t, 1, func(c *Config) { c.Netns = fakeFinder{distinct: tc.distinct} })
			add := addReq(e.web, e.ns["shop"], "uid-web")
			add.ContainerID = "sandbox-web"
			if _, err := e.r.CNIAdd(context.Background(), add); err != nil {
				t.Fatal(err)
			}
			if err := e.r.CNIDel(context.Background(), tc.del); err != nil {
				t.Fatal(err)
			}
			if !e.dp.has("uid-web") || e.r.Redirection("uid-web") == enrollment.RedirectionNone {
				t.Errorf("DEL %v removed pod uid-web", tc.del)
			}
		})
	}
	// Two members under one name (a pod and its replacement, both known
	// only by name): which one the DEL is about cannot be told.
	e := newTestEnv(t, 1)
	replacement := e.web.DeepCopy()
	replacement.UID = "uid-web-2"
	for _, p := range []*corev1.Pod{e.web, replacement} {
		mb := &member{uid: string(p.UID), namespace: p.Namespace, name: p.Name, netns: "/proc/1/ns/net", opts: podopts.Options{}}
		if _, err := e.r.add(context.Background(), mb, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.r.CNIDel(context.Background(), CNIDel{Namespace: "shop", Name: "web", Netns: "/run/netns/y"}); err != nil {
		t.Fatal(err)
	}
	if e.dp.count() != 2 {
		t.Errorf("an ambiguous DEL removed a pod: %v", e.dp.enrolled)
	}
}

// The last check before the data path: names, uid and interfaces that
// would make a pin path, from whichever source, never reach Enroll.
func TestEnrollRefusesIdentitiesThatWouldMakeAPath(t *testing.T) {
	e := newTestEnv(t, 1)
	rerouted := e.web.DeepCopy()
	rerouted.Annotations = map[string]string{enrollment.RerouteInterfacesAnnotation: "tun0,/../../../maps"}
	if err := e.liveAdd(t, rerouted); !errors.Is(err, validate.ErrInvalid) {
		t.Errorf("live add with reroute %v = %v; want an invalid identity", rerouted.Annotations, err)
	}
	traversal := e.web.DeepCopy()
	traversal.UID = "../../links"
	mb := &member{uid: string(traversal.UID), namespace: "shop", name: "web", netns: "/proc/1/ns/net"}
	if _, err := e.r.add(context.Background(), mb, false); !errors.Is(err, validate.ErrInvalid) {
		t.Errorf("add of uid %q = %v; want an invalid identity", traversal.UID, err)
	}
	if _, err := e.r.CNIAdd(context.Background(), addReq(traversal, e.ns["shop"], "")); !errors.Is(err, validate.ErrInvalid) {
		t.Errorf("CNIAdd of a pod whose source uid is a traversal = %v", err)
	}
	if e.dp.count() != 0 {
		t.Errorf("dataplane got %v", e.dp.enrolled)
	}
}

// A pod enrolled by its CNI ADD before the informers reported it survives
// the removal of an older pod of the same name; once reported, its own
// deletion removes it.
func TestCNIEnrolledPodSurvivesTheDeleteOfItsPredecessor(t *testing.T) {
	e := newTestEnv(t, 1)
	if _, err := e.r.CNIAdd(context.Background(), addReq(e.web, e.ns["shop"], "uid-web")); err != nil {
		t.Fatal(err)
	}
	e.r.DeletePod("shop", "web") // the informers' delete of the previous shop/web
	if err := e.r.reconcile(context.Background(), "shop/web"); err != nil {
		t.Fatal(err)
	}
	if !e.dp.has("uid-web") || e.r.Redirection("uid-web") != enrollment.RedirectionEnabled {
		t.Fatalf("the delete of an older pod of the name removed the new one: %v", e.dp.enrolled)
	}
	if err := e.liveAdd(t, e.web); err != nil { // reported now
		t.Fatal(err)
	}
	e.r.DeletePod("shop", "web")
	if err := e.r.reconcile(context.Background(), "shop/web"); err != nil {
		t.Fatal(err)
	}
	if e.dp.has("uid-web") || e.r.Redirection("uid-web") != enrollment.RedirectionNone {
		t.Errorf("deleted pod still enrolled: %v", e.dp.enrolled)
	}
}

// A running pod that becomes ambient (its namespace labelled) is enrolled
// live, as istio-cni does: whatever the repair mode (never Unredirected,
// which the delete and label modes act on), and published as a plain
// enrolment, not a repair (test/differential's live label changes: no
// Event). A running ambient pod first seen unredirected is still a repair.
func TestARunningPodThatBecomesAmbientIsEnrolledNotRepaired(t *testing.T) {
	for _, inPlace := range []bool{true, false} {
		t.Run(fmt.Sprintf("repair in place %t", inPlace), func(t *testing.T) {
			e := newTestEnv(t, 1, func(c *Config) { c.RepairInPlace = inPlace })
			pod := e.web.DeepCopy()
			plain := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop"}}
			e.r.SetPod(pod, plain)
			if err := e.r.reconcile(context.Background(), "shop/web"); err != nil || e.dp.has("uid-web") {
				t.Fatalf("outside the mesh: %v, enrolled %t", err, e.dp.has("uid-web"))
			}
			if err := e.liveAdd(t, pod); err != nil {
				t.Fatal(err)
			}
			c, _ := e.chg.last("uid-web")
			if !e.dp.has("uid-web") || c.Repair != RepairNothing {
				t.Errorf("labelled ambient while running: enrolled %t, published repair %v", e.dp.has("uid-web"), c.Repair)
			}

			other := e.web.DeepCopy()
			other.Name, other.UID = "db", "uid-db"
			err := e.liveAdd(t, other)
			c, _ = e.chg.last("uid-db")
			want := Unredirected
			if inPlace {
				want = RepairedInPlace
			}
			if err != nil || c.Repair != want {
				t.Errorf("first seen ambient and unredirected: %v, published repair %v, want %v", err, c.Repair, want)
			}
		})
	}
}
