// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/identity"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

type fakeDataplane struct {
	mu       sync.Mutex
	enrolled map[string]dataplane.Pod
	fail     error
}

func (f *fakeDataplane) Enroll(_ context.Context, p dataplane.Pod) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	f.enrolled[p.UID] = p
	return nil
}

func (f *fakeDataplane) Remove(_ context.Context, uid string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.enrolled, uid)
	return nil
}

func (f *fakeDataplane) List() []dataplane.EnrolledPod { return nil }

type fakeZtunnel struct {
	mu    sync.Mutex
	conns int
	added []string
	nack  error
}

func (f *fakeZtunnel) AddWorkload(_ context.Context, w zds.Workload) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.conns == 0 {
		return zds.ErrNoZtunnel
	}
	if f.nack != nil {
		return f.nack
	}
	f.added = append(f.added, w.UID)
	return nil
}

func (f *fakeZtunnel) DelWorkload(context.Context, string) error { return nil }
func (f *fakeZtunnel) Connections() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.conns
}

type fakeSource struct {
	pods     map[string]*corev1.Pod
	ns       map[string]*corev1.Namespace
	requeued []string
}

func (s *fakeSource) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	p := s.pods[namespace+"/"+name]
	if p == nil {
		return nil, nil, errors.New("no such pod")
	}
	return p, s.ns[namespace], nil
}

func (s *fakeSource) Requeue(namespace, name string) {
	s.requeued = append(s.requeued, namespace+"/"+name)
}

// fakeFinder finds every pod's netns at /proc/1/ns/net. Different netns
// paths are of unknown sameness, unless distinct says they are different
// namespaces.
type fakeFinder struct{ distinct bool }

func (fakeFinder) Find(types.UID) (podnetns.NetNS, error) {
	return podnetns.NetNS{Path: "/proc/1/ns/net"}, nil
}

func (f fakeFinder) FindAll(uids []types.UID) (map[types.UID]podnetns.NetNS, error) {
	out := map[types.UID]podnetns.NetNS{}
	for _, u := range uids {
		out[u], _ = f.Find(u)
	}
	return out, nil
}

func (f fakeFinder) Same(a, b string) (same, known bool) {
	if a == b {
		return true, true
	}
	return false, f.distinct
}

func newTestMesh(conns int) (*mesh, *fakeDataplane, *fakeZtunnel, *fakeSource) {
	dp := &fakeDataplane{enrolled: map[string]dataplane.Pod{}}
	zt := &fakeZtunnel{conns: conns}
	src := &fakeSource{
		pods: map[string]*corev1.Pod{
			"shop/web":   {ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", UID: "uid-web"}},
			"legacy/job": {ObjectMeta: metav1.ObjectMeta{Name: "job", Namespace: "legacy", UID: "uid-job"}},
		},
		ns: map[string]*corev1.Namespace{
			"shop": {ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}},
		},
	}
	m := newMesh(dp, zt, fakeFinder{}, enrollment.DefaultConfig(), slog.Default(), newMetrics(kube.RepairInPlace, false))
	m.setSource(src)
	return m, dp, zt, src
}

func addReq(ns, name, uid string) *cniv1.PodAddRequest {
	return &cniv1.PodAddRequest{Pod: &cniv1.Pod{Namespace: ns, Name: name, Uid: uid, Netns: "/run/netns/x", Interface: "eth0"}, Ips: []string{"198.18.0.10"}}
}

func TestPodAddEnrollsAmbientPodsAndRequeuesThem(t *testing.T) {
	m, dp, zt, src := newTestMesh(1)
	res, err := m.PodAdd(context.Background(), addReq("shop", "web", "uid-web"))
	if err != nil || !res.Enrolled {
		t.Fatalf("PodAdd = %+v, %v", res, err)
	}
	if _, ok := dp.enrolled["uid-web"]; !ok || len(zt.added) != 1 {
		t.Errorf("dataplane %v, ztunnel %v", dp.enrolled, zt.added)
	}
	if m.Redirection("uid-web") != kube.RedirectionEnabled || len(src.requeued) != 1 {
		t.Errorf("state %q, requeued %v", m.Redirection("uid-web"), src.requeued)
	}
}

func TestPodAddLeavesNonAmbientPodsAlone(t *testing.T) {
	m, dp, _, _ := newTestMesh(1)
	res, err := m.PodAdd(context.Background(), addReq("legacy", "job", "uid-job"))
	if err != nil || res.Enrolled || len(dp.enrolled) != 0 {
		t.Fatalf("PodAdd = %+v, %v; dataplane %v", res, err, dp.enrolled)
	}
}

// Fail closed: without ztunnel the ADD fails, says why, and leaves nothing.
func TestPodAddFailsClosedWithoutZtunnel(t *testing.T) {
	m, dp, _, _ := newTestMesh(0)
	_, err := m.PodAdd(context.Background(), addReq("shop", "web", "uid-web"))
	if !errors.Is(err, events.ErrNoZtunnel) {
		t.Fatalf("PodAdd error = %v, want ErrNoZtunnel", err)
	}
	if len(dp.enrolled) != 0 || m.count() != 0 {
		t.Errorf("state left after a failed ADD: dataplane %v, members %d", dp.enrolled, m.count())
	}
}

func TestPodAddFailsOnDataplaneErrorAndUIDMismatch(t *testing.T) {
	m, dp, _, _ := newTestMesh(1)
	dp.fail = errors.New("attach failed")
	if _, err := m.PodAdd(context.Background(), addReq("shop", "web", "uid-web")); err == nil {
		t.Error("PodAdd succeeded although the dataplane failed")
	}
	dp.fail = nil
	if _, err := m.PodAdd(context.Background(), addReq("shop", "web", "other-uid")); err == nil {
		t.Error("PodAdd succeeded for a UID the API does not know")
	}
}

// Live enrollment without ztunnel: redirected and pending; enabled once
// ztunnel connects.
func TestPendingPodsTurnEnabledWhenZtunnelConnects(t *testing.T) {
	m, _, zt, src := newTestMesh(0)
	pod := src.pods["shop/web"]
	if err := m.AddPodToMesh(context.Background(), pod, enrollment.Options{}); err != nil {
		t.Fatal(err)
	}
	if got := m.Redirection(pod.UID); got != kube.RedirectionPending {
		t.Fatalf("state %q, want pending", got)
	}
	zt.conns = 1
	m.retryPending(context.Background())
	if got := m.Redirection(pod.UID); got != kube.RedirectionEnabled {
		t.Errorf("state %q after ztunnel connected, want enabled", got)
	}
	if len(m.snapshot()) != 1 {
		t.Errorf("snapshot %v", m.snapshot())
	}
}

func delReq(p *cniv1.Pod) *cniv1.PodDelRequest { return &cniv1.PodDelRequest{Pod: p} }

// A DEL without K8S_POD_UID finds the pod the CNI ADD enrolled by its
// sandbox, its netns or its names, as the runtime gives them.
func TestPodDelWithoutUIDFindsTheEnrolledPod(t *testing.T) {
	cases := map[string]*cniv1.Pod{
		"names":           {Namespace: "shop", Name: "web"},
		"names and more":  {Namespace: "shop", Name: "web", ContainerId: "sandbox-web", Netns: "/run/netns/x", Interface: "eth0"},
		"container id":    {ContainerId: "sandbox-web"},
		"netns":           {Netns: "/run/netns/x"},
		"names and netns": {Namespace: "shop", Name: "web", Netns: "/run/netns/x"},
	}
	for name, p := range cases {
		t.Run(name, func(t *testing.T) {
			m, dp, _, _ := newTestMesh(1)
			add := addReq("shop", "web", "uid-web")
			add.Pod.ContainerId = "sandbox-web"
			if _, err := m.PodAdd(context.Background(), add); err != nil {
				t.Fatal(err)
			}
			if err := m.PodDel(context.Background(), delReq(p)); err != nil {
				t.Fatal(err)
			}
			if len(dp.enrolled) != 0 || m.Redirection("uid-web") != kube.RedirectionNone {
				t.Errorf("pod still enrolled after DEL %v: dataplane %v", p, dp.enrolled)
			}
		})
	}
}

// A pod enrolled live or adopted has no sandbox on record and a /proc netns
// path: its names find it.
func TestPodDelWithoutUIDFindsALiveEnrolledPodByName(t *testing.T) {
	m, dp, _, src := newTestMesh(1)
	if err := m.AddPodToMesh(context.Background(), src.pods["shop/web"], enrollment.Options{}); err != nil {
		t.Fatal(err)
	}
	if err := m.PodDel(context.Background(), delReq(&cniv1.Pod{Namespace: "shop", Name: "web", ContainerId: "c9", Netns: "/run/netns/x"})); err != nil {
		t.Fatal(err)
	}
	if len(dp.enrolled) != 0 {
		t.Errorf("pod still enrolled: %v", dp.enrolled)
	}
}

// Removing pod A never removes pod B: a DEL about another sandbox, another
// netns, or a name two members share removes nothing.
func TestPodDelNeverRemovesAnotherPod(t *testing.T) {
	cases := []struct {
		name     string
		distinct bool
		del      *cniv1.Pod
	}{
		{"older sandbox of the same uid", false, &cniv1.Pod{Namespace: "shop", Name: "web", Uid: "uid-web", ContainerId: "sandbox-old"}},
		{"older sandbox, no uid", false, &cniv1.Pod{Namespace: "shop", Name: "web", ContainerId: "sandbox-old"}},
		{"another netns, no uid", true, &cniv1.Pod{Namespace: "shop", Name: "web", Netns: "/run/netns/old"}},
		{"another pod's names", false, &cniv1.Pod{Namespace: "shop", Name: "db"}},
		{"nothing in common", false, &cniv1.Pod{ContainerId: "c2"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, dp, _, _ := newTestMesh(1)
			m.netns = fakeFinder{distinct: tc.distinct}
			add := addReq("shop", "web", "uid-web")
			add.Pod.ContainerId = "sandbox-web"
			if _, err := m.PodAdd(context.Background(), add); err != nil {
				t.Fatal(err)
			}
			if err := m.PodDel(context.Background(), delReq(tc.del)); err != nil {
				t.Fatal(err)
			}
			if _, ok := dp.enrolled["uid-web"]; !ok || m.Redirection("uid-web") == kube.RedirectionNone {
				t.Errorf("DEL %v removed pod uid-web", tc.del)
			}
		})
	}
	// Two members under one name (a pod and its replacement, both known
	// only by name): which one the DEL is about cannot be told.
	m, dp, _, src := newTestMesh(1)
	replacement := src.pods["shop/web"].DeepCopy()
	replacement.UID = "uid-web-2"
	for _, p := range []*corev1.Pod{src.pods["shop/web"], replacement} {
		if err := m.AddPodToMesh(context.Background(), p, enrollment.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.PodDel(context.Background(), delReq(&cniv1.Pod{Namespace: "shop", Name: "web", Netns: "/run/netns/y"})); err != nil {
		t.Fatal(err)
	}
	if len(dp.enrolled) != 2 {
		t.Errorf("an ambiguous DEL removed a pod: %v", dp.enrolled)
	}
}

// The last check before the dataplane: names, uid and interfaces that
// would make a pin path, from whichever source, never reach Enroll.
func TestEnrollRefusesIdentitiesThatWouldMakeAPath(t *testing.T) {
	m, dp, _, src := newTestMesh(1)
	rerouted := src.pods["shop/web"].DeepCopy()
	rerouted.Annotations = map[string]string{enrollment.RerouteInterfacesAnnotation: "tun0,/../../../maps"}
	traversal := src.pods["shop/web"].DeepCopy()
	traversal.UID = "../../links"
	for _, p := range []*corev1.Pod{rerouted, traversal} {
		err := m.AddPodToMesh(context.Background(), p, enrollment.PodOptions(enrollment.DefaultConfig(), p))
		if !errors.Is(err, identity.ErrInvalid) {
			t.Errorf("AddPodToMesh(uid %q, annotations %v) = %v; want an invalid identity", p.UID, p.Annotations, err)
		}
	}
	src.pods["shop/web"].UID = "../../links"
	if _, err := m.PodAdd(context.Background(), addReq("shop", "web", "")); !errors.Is(err, identity.ErrInvalid) {
		t.Errorf("PodAdd of a pod whose source uid is a traversal = %v", err)
	}
	if len(dp.enrolled) != 0 {
		t.Errorf("dataplane got %v", dp.enrolled)
	}
}
