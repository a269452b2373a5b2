// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"istio.io/istio/pkg/zdsapi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

type nopDataplane struct{}

func (nopDataplane) Enroll(context.Context, dataplane.Pod) error { return nil }
func (nopDataplane) Remove(context.Context, string) error        { return nil }
func (nopDataplane) List() []inspect.EnrolledPod                 { return nil }

// selfNetns finds the pod uid-web in this process's netns, a real one
// ZDS can pass to ztunnel.
type selfNetns struct{}

func (selfNetns) Scan(context.Context) (map[types.UID]podnetns.NetNS, error) {
	return map[types.UID]podnetns.NetNS{"uid-web": {Path: "/proc/self/ns/net"}}, nil
}
func (selfNetns) Current(types.UID, podnetns.NetNS) bool { return true }
func (selfNetns) Same(a, b string) (bool, bool)          { return a == b, a == b }

// heldZtunnel acks every Add and Keep, and holds SnapshotSent until
// released: whatever the agent learns before that, it learnt from the
// snapshot entries' acks.
type heldZtunnel struct {
	mu      sync.Mutex
	adds    []string
	release chan struct{}
}

func (z *heldZtunnel) Add(_ context.Context, uid string, _ *zdsapi.WorkloadInfo, _ *os.File) error {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.adds = append(z.adds, uid)
	return nil
}
func (z *heldZtunnel) Keep(context.Context, string) error { return nil }
func (z *heldZtunnel) Del(context.Context, string) error  { return nil }
func (z *heldZtunnel) SnapshotSent(context.Context, []string) error {
	<-z.release
	return nil
}

func (z *heldZtunnel) addCount() int {
	z.mu.Lock()
	defer z.mu.Unlock()
	return len(z.adds)
}

// pending -> enabled within one ack: a pod enrolled while no ztunnel is
// connected turns enabled on the ack of its snapshot entry, while the
// connection's snapshot is still open, with no poll and no second Add.
func TestPendingPodTurnsEnabledOnTheAckOfItsSnapshotEntry(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var rec *reconciler.Reconciler
	sock := filepath.Join(t.TempDir(), "ztunnel.sock")
	srv, err := zds.NewServer(zds.Config{SocketPath: sock, Logger: log,
		Snapshot: func() []zds.Workload { return rec.Snapshot() }, OnAck: func(a zds.Ack) { rec.OnAck(a) }})
	if err != nil {
		t.Fatal(err)
	}
	rec, err = reconciler.New(reconciler.Config{Enrollment: enrollment.DefaultConfig(), Dataplane: nopDataplane{}, Ztunnel: srv,
		Netns: selfNetns{}, RepairInPlace: true, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	enabled := make(chan struct{})
	var once sync.Once
	rec.Subscribe(func(c reconciler.Change) {
		if c.UID == "uid-web" && c.Redirection == enrollment.RedirectionEnabled {
			once.Do(func() { close(enabled) })
		}
	})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { _ = srv.Run(ctx) })
	wg.Go(func() { _ = rec.Run(ctx) })
	<-srv.Ready()

	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", UID: "uid-web",
		Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.0.10"}}
	rec.SetPod(pod, nil)
	rec.Synced()
	for rec.Redirection(pod.UID) != enrollment.RedirectionPending {
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Millisecond):
		}
	}

	zt := &heldZtunnel{release: make(chan struct{})}
	defer close(zt.release)
	client, err := zdsclient.New(zdsclient.Config{SocketPath: sock, Handler: zt, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	wg.Go(func() { _ = client.Run(ctx) })
	select {
	case <-enabled:
	case <-time.After(30 * time.Second):
		t.Fatal("pod never turned enabled")
	}
	// ztunnel has not answered SnapshotSent (it holds it until the test
	// ends), and a live Add would queue behind the snapshot (Z7): the only
	// answer the agent can have had is the ack of the snapshot entry.
	if n := zt.addCount(); n != 1 {
		t.Errorf("ztunnel got %d Adds by the time the pod was enabled; want 1 (its snapshot entry)", n)
	}
	if got := rec.Redirection(pod.UID); got != enrollment.RedirectionEnabled {
		t.Errorf("state %q", got)
	}
}
