// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zdsclient

import (
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// fakePods is a PodSet that remembers the netns identity of each pod.
type fakePods struct {
	tb   testing.TB
	mu   sync.Mutex
	pods map[string]nstest.Ident
	fail error
}

func (f *fakePods) AddPod(uid string, netns *os.File) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fail != nil {
		return f.fail
	}
	f.pods[uid] = nstest.IdentOfFD(f.tb, int(netns.Fd()))
	return nil
}

func (f *fakePods) DelPod(uid string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.pods, uid)
}

func (f *fakePods) Pods() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Sorted(maps.Keys(f.pods))
}

func (f *fakePods) waitPods(want ...string) {
	f.tb.Helper()
	if !testenv.Poll(5*time.Second, func() bool { return slices.Equal(f.Pods(), want) }) {
		f.tb.Fatalf("pods %v, want %v", f.Pods(), want)
	}
}

// TestZ3PodSetDropsPodsMissingFromTheSnapshot: after an agent restart the
// stand-in keeps the pods the snapshot names (Add or Keep) and drops the
// rest at SnapshotSent; live Add and Del change the set, a failing AddPod
// is a NACK.
func TestZ3PodSetDropsPodsMissingFromTheSnapshot(t *testing.T) {
	nsA, nsB := nstest.NewNetns(t), nstest.NewNetns(t)
	path := filepath.Join(t.TempDir(), "zds.sock")
	_, stop := runServer(t, path, func() []zds.Workload {
		return []zds.Workload{{UID: "a", Netns: nsA}, {UID: "b", Netns: nsB}, {UID: "c", Netns: nsA}}
	})
	pods := &fakePods{tb: t, pods: map[string]nstest.Ident{}}
	runClient(t, Config{SocketPath: path, Handler: HandlerFor(pods), MinBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})
	pods.waitPods("a", "b", "c")
	pods.mu.Lock()
	if pods.pods["b"] != nstest.IdentOfPath(t, nsB) {
		t.Fatalf("pod b in %+v, want %s", pods.pods["b"], nsB)
	}
	pods.mu.Unlock()

	// The agent restarts knowing a (netns unknown now: Keep) and b only.
	stop()
	srv, _ := runServer(t, path, func() []zds.Workload { return []zds.Workload{{UID: "a"}, {UID: "b", Netns: nsB}} })
	pods.waitPods("a", "b")

	testenv.Eventually(t, 5*time.Second, "a client connected", func() bool { return srv.Connections() > 0 })
	ctx := context.Background()
	if err := srv.AddWorkload(ctx, zds.Workload{UID: "d", Netns: nsA}); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}
	pods.waitPods("a", "b", "d")
	if err := srv.DelWorkload(ctx, "a"); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
	pods.waitPods("b", "d")
	pods.mu.Lock()
	pods.fail = errors.New("listen 15001: address in use")
	pods.mu.Unlock()
	if err := srv.AddWorkload(ctx, zds.Workload{UID: "e", Netns: nsA}); !errors.Is(err, zds.ErrNack) {
		t.Fatalf("AddWorkload with failing AddPod: %v", err)
	}
}
