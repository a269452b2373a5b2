// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
)

// pods is a concurrency-safe pod list standing in for the agent's state.
type pods struct {
	mu sync.Mutex
	ws []Workload
}

func (p *pods) set(ws ...Workload) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ws = ws
}

func (p *pods) snapshot() []Workload {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Workload(nil), p.ws...)
}

func uids(reqs []*zdsapi.WorkloadRequest) []string {
	var out []string
	for _, r := range reqs {
		switch {
		case r.GetAdd() != nil:
			out = append(out, "add:"+r.GetAdd().GetUid())
		case r.GetKeep() != nil:
			out = append(out, "keep:"+r.GetKeep().GetUid())
		default:
			out = append(out, r.String())
		}
	}
	return out
}

func TestNewServerValidatesWithoutIO(t *testing.T) {
	if _, err := NewServer(Config{SocketPath: "relative.sock"}); err == nil {
		t.Fatal("relative socket path accepted")
	}
	if _, err := NewServer(Config{HelloTimeout: -1}); err == nil {
		t.Fatal("negative timeout accepted")
	}
	s, err := NewServer(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if s.cfg.SocketPath != DefaultSocketPath || s.cfg.HelloTimeout != 5*time.Second || s.cfg.AckTimeout != 5*time.Second {
		t.Fatalf("defaults: %+v", s.cfg)
	}
}

// TestRunRemovesStaleSocketAndListensRootOnly: a leftover socket file from
// a dead agent is replaced, the new socket is mode 0600, and it is removed
// when the server stops.
func TestRunRemovesStaleSocketAndListensRootOnly(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ztunnel")
	path := filepath.Join(dir, "ztunnel.sock")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	stale, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()

	h := startServer(t, Config{SocketPath: path})
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want socket 0600", fi.Mode())
	}
	p := dialRaw(t, path)
	p.handshake(0)
	testenv.Eventually(t, time.Second, "one connection", func() bool { return h.srv.Connections() == 1 })
	h.stop()
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind after stop: %v", err)
	}
	p.expectClosed(2 * time.Second)
}

// TestSecondServerOnALiveSocketIsRefused: a server whose path another
// listener answers on (another agent, or the CNI socket's path given to
// the wrong flag) refuses to start and leaves that listener working.
func TestSecondServerOnALiveSocketIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "zds.sock")
	first := startServer(t, Config{SocketPath: path})
	s, err := NewServer(Config{SocketPath: path})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); !errors.Is(err, unixsock.ErrInUse) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Run on a live socket: %v", err)
	}
	dialRaw(t, path).handshake(0)
	testenv.Eventually(t, time.Second, "the first server still serves", func() bool { return first.srv.Connections() == 1 })
}

func TestRunRefusesToRemoveANonSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "zds.sock")
	if err := os.WriteFile(path, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := NewServer(Config{SocketPath: path})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); !errors.Is(err, unixsock.ErrNotSocket) {
		t.Fatalf("Run: %v", err)
	}
	if b, err := os.ReadFile(path); err != nil || string(b) != "x" {
		t.Fatalf("the file is now %q, %v", b, err)
	}
}

// TestZ2SnapshotOnConnectAndAfterAgentRestart: every new connection gets
// the snapshot, Add with fd for a known netns and Keep for an unknown one;
// a new server instance on the same path (an agent restart) does the same.
func TestZ2SnapshotOnConnectAndAfterAgentRestart(t *testing.T) {
	ns := nstest.NewNetns(t)
	state := &pods{}
	state.set(
		Workload{UID: "known", Name: "k", Namespace: "default", ServiceAccount: "sa", Netns: ns},
		Workload{UID: "unknown", Name: "u", Namespace: "default", ServiceAccount: "sa"},
		Workload{UID: "gone", Name: "g", Namespace: "default", ServiceAccount: "sa", Netns: "/var/run/netns/zds-does-not-exist-" + testenv.RunID()},
	)
	path := filepath.Join(t.TempDir(), "zds.sock")
	want := "[add:known keep:unknown keep:gone]"

	h1 := startServer(t, Config{SocketPath: path, Snapshot: state.snapshot})
	p1 := dialRaw(t, path)
	if got := uids(p1.handshake(3)); strings.Join(got, " ") != strings.Trim(want, "[]") {
		t.Fatalf("first agent snapshot %v, want %s", got, want)
	}
	h1.logs.waitLine(t, "netns unavailable; sending keep", "gone")
	h1.stop()
	p1.expectClosed(2 * time.Second)

	h2 := startServer(t, Config{SocketPath: path, Snapshot: state.snapshot})
	p2 := dialRaw(t, path)
	if got := uids(p2.handshake(3)); strings.Join(got, " ") != strings.Trim(want, "[]") {
		t.Fatalf("restarted agent snapshot %v, want %s", got, want)
	}
	testenv.Eventually(t, time.Second, "connection registered", func() bool { return h2.srv.Connections() == 1 })
}

// TestZ4LiveAddDelOneInFlight: live requests are acked one at a time; a
// second request is not written before the first is acked.
func TestZ4LiveAddDelOneInFlight(t *testing.T) {
	ns := nstest.NewNetns(t)
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.handshake(0)
	ctx := context.Background()

	first := doAsync(func() error {
		return h.srv.AddWorkload(ctx, Workload{UID: "p1", Name: "p1", Namespace: "d", Netns: ns})
	})
	req, _ := p.recv()
	if req.GetAdd().GetUid() != "p1" {
		t.Fatalf("got %v", req)
	}
	second := doAsync(func() error { return h.srv.DelWorkload(ctx, "p0") })
	p.expectNothing(300 * time.Millisecond)
	p.ack("")
	if err := waitErr(t, first); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}
	req, _ = p.recv()
	if req.GetDel().GetUid() != "p0" {
		t.Fatalf("got %v", req)
	}
	p.ack("")
	if err := waitErr(t, second); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
}

// TestZ4AckTimeoutFailsRequestAndEndsConnection: no ack within the deadline
// fails the call and drops the connection.
func TestZ4AckTimeoutFailsRequestAndEndsConnection(t *testing.T) {
	h := startServer(t, Config{AckTimeout: 300 * time.Millisecond})
	p := dialRaw(t, h.path)
	p.handshake(0)
	testenv.Eventually(t, time.Second, "registered", func() bool { return h.srv.Connections() == 1 })
	start := time.Now()
	err := h.srv.DelWorkload(context.Background(), "p1")
	if err == nil || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("DelWorkload without ack: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("timeout took %v", took)
	}
	p.expectClosed(2 * time.Second)
	testenv.Eventually(t, time.Second, "connection dropped", func() bool { return h.srv.Connections() == 0 })
	h.logs.waitLine(t, "connection ended", "no ack for del p1 within deadline")
}

// TestZ4PeerLeavingMidRequestFailsTheCall: a ztunnel that disconnects
// while an Add is in flight fails that Add; the server notices at once.
func TestZ4PeerLeavingMidRequestFailsTheCall(t *testing.T) {
	ns := nstest.NewNetns(t)
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.handshake(0)
	testenv.Eventually(t, time.Second, "registered", func() bool { return h.srv.Connections() == 1 })
	done := doAsync(func() error { return h.srv.AddWorkload(context.Background(), Workload{UID: "p1", Netns: ns}) })
	p.recv()
	_ = p.uc.Close()
	err := waitErr(t, done)
	if err == nil || !strings.Contains(err.Error(), "peer closed the connection") {
		t.Fatalf("AddWorkload to a departed peer: %v", err)
	}
	testenv.Eventually(t, time.Second, "connection dropped", func() bool { return h.srv.Connections() == 0 })
	if err := h.srv.AddWorkload(context.Background(), Workload{UID: "p1", Netns: ns}); !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("AddWorkload with nobody left: %v", err)
	}
}

// TestZ6Z7NackFromOneConnectionFailsDelButReachesTheOther.
func TestZ6Z7NackFromOneConnectionFailsDelButReachesTheOther(t *testing.T) {
	h := startServer(t, Config{})
	a, b := dialRaw(t, h.path), dialRaw(t, h.path)
	a.handshake(0)
	b.handshake(0)
	testenv.Eventually(t, time.Second, "two connections", func() bool { return h.srv.Connections() == 2 })
	done := doAsync(func() error { return h.srv.DelWorkload(context.Background(), "p1") })
	a.recv()
	b.recv()
	a.ack("no such workload")
	b.ack("")
	err := waitErr(t, done)
	if !errors.Is(err, ErrNack) || !strings.Contains(err.Error(), "no such workload") {
		t.Fatalf("DelWorkload with one NACK: %v", err)
	}
	h.delThrough(t, "p2", a, b) // both connections stay
}

// TestZ9RepeatedAddCarriesTheSameNetnsIdentity: each Add opens the netns
// afresh, but the descriptor always names the same (dev, inode), which is
// what lets ztunnel treat a repeated Add as harmless.
func TestZ9RepeatedAddCarriesTheSameNetnsIdentity(t *testing.T) {
	ns := nstest.NewNetns(t)
	h := startServer(t, Config{Snapshot: func() []Workload { return []Workload{{UID: "p1", Netns: ns}} }})
	p := dialRaw(t, h.path)
	p.hello()
	want := nstest.IdentOfPath(t, ns)
	check := func(d datagram) {
		t.Helper()
		if len(d.fds) != 1 || nstest.IdentOfFD(t, d.fds[0]) != want {
			t.Fatalf("add carried %d fds, want one naming %+v", len(d.fds), want)
		}
	}
	_, d := p.recv()
	check(d)
	p.ack("")
	p.recv() // snapshot_sent
	p.ack("")
	for range 2 {
		done := doAsync(func() error { return h.srv.AddWorkload(context.Background(), Workload{UID: "p1", Netns: ns}) })
		_, d := p.recv()
		check(d)
		p.ack("")
		if err := waitErr(t, done); err != nil {
			t.Fatalf("repeated AddWorkload: %v", err)
		}
	}
}

// TestZ6NackReturnsErrorAndKeepsConnection.
func TestZ6NackReturnsErrorAndKeepsConnection(t *testing.T) {
	ns := nstest.NewNetns(t)
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.handshake(0)
	ctx := context.Background()

	done := doAsync(func() error { return h.srv.AddWorkload(ctx, Workload{UID: "p1", Netns: ns}) })
	p.recv()
	p.ack("cannot open listeners: address in use")
	err := waitErr(t, done)
	if !errors.Is(err, ErrNack) || !strings.Contains(err.Error(), "cannot open listeners: address in use") {
		t.Fatalf("NACKed AddWorkload: %v", err)
	}
	// The same connection serves the next request.
	done = doAsync(func() error { return h.srv.AddWorkload(ctx, Workload{UID: "p1", Netns: ns}) })
	p.recv()
	p.ack("")
	if err := waitErr(t, done); err != nil {
		t.Fatalf("AddWorkload after NACK: %v", err)
	}
	if n := h.srv.Connections(); n != 1 {
		t.Fatalf("connections %d after NACK", n)
	}
}

func TestZ7AddWithoutZtunnelFailsAndDelIsANoop(t *testing.T) {
	ns := nstest.NewNetns(t)
	h := startServer(t, Config{})
	err := h.srv.AddWorkload(context.Background(), Workload{UID: "p1", Netns: ns})
	if !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("AddWorkload with no ztunnel: %v", err)
	}
	if err := h.srv.DelWorkload(context.Background(), "p1"); err != nil {
		t.Fatalf("DelWorkload with no ztunnel: %v", err)
	}
	// A connection that has not said hello is not a ztunnel yet.
	dialRaw(t, h.path)
	time.Sleep(100 * time.Millisecond)
	if err := h.srv.AddWorkload(context.Background(), Workload{UID: "p1", Netns: ns}); !errors.Is(err, ErrNoZtunnel) {
		t.Fatalf("AddWorkload with a silent peer: %v", err)
	}
}

// TestZ7ZtunnelRestartOverlappingConnections: during a ztunnel rollout two
// connections overlap. The new one gets the full snapshot, Add goes only
// to the newest, Del to both; when the old one leaves the new one carries on.
func TestZ7ZtunnelRestartOverlappingConnections(t *testing.T) {
	nsOld, nsNew := nstest.NewNetns(t), nstest.NewNetns(t)
	state := &pods{}
	state.set(Workload{UID: "existing", Name: "e", Namespace: "d", ServiceAccount: "sa", Netns: nsOld})
	h := startServer(t, Config{Snapshot: state.snapshot})
	ctx := context.Background()

	oldZ := dialRaw(t, h.path)
	if got := uids(oldZ.handshake(1)); len(got) != 1 || got[0] != "add:existing" {
		t.Fatalf("old ztunnel snapshot %v", got)
	}
	newZ := dialRaw(t, h.path)
	if got := uids(newZ.handshake(1)); len(got) != 1 || got[0] != "add:existing" {
		t.Fatalf("new ztunnel snapshot %v", got)
	}
	testenv.Eventually(t, time.Second, "two connections", func() bool { return h.srv.Connections() == 2 })

	done := doAsync(func() error {
		return h.srv.AddWorkload(ctx, Workload{UID: "fresh", Name: "f", Namespace: "d", ServiceAccount: "sa", Netns: nsNew})
	})
	req, d := newZ.recv()
	if req.GetAdd().GetUid() != "fresh" || len(d.fds) != 1 || nstest.IdentOfFD(t, d.fds[0]) != nstest.IdentOfPath(t, nsNew) {
		t.Fatalf("newest got %v with %d fds", req, len(d.fds))
	}
	newZ.ack("")
	if err := waitErr(t, done); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}
	oldZ.expectNothing(200 * time.Millisecond)

	h.delThrough(t, "existing", oldZ, newZ)

	// The old ztunnel exits; the new one keeps receiving.
	_ = oldZ.uc.Close()
	testenv.Eventually(t, 5*time.Second, "old connection dropped", func() bool { return h.srv.Connections() == 1 })
	h.delThrough(t, "fresh", newZ)
}

// TestZ7LiveAddDuringSnapshotIsQueuedBehindIt: a connection registered
// but still in its snapshot receives live changes after SnapshotSent.
func TestZ7LiveAddDuringSnapshotIsQueuedBehindIt(t *testing.T) {
	h := startServer(t, Config{Snapshot: func() []Workload { return []Workload{{UID: "s1"}} }})
	p := dialRaw(t, h.path)
	p.hello()
	req, _ := p.recv() // keep s1, not acked yet
	if req.GetKeep().GetUid() != "s1" {
		t.Fatalf("got %v", req)
	}
	testenv.Eventually(t, time.Second, "registered", func() bool { return h.srv.Connections() == 1 })
	done := doAsync(func() error { return h.srv.DelWorkload(context.Background(), "late") })
	p.ack("")
	if req, _ := p.recv(); req.GetSnapshotSent() == nil {
		t.Fatalf("got %v, want snapshot_sent before live changes", req)
	}
	p.ack("")
	if req, _ := p.recv(); req.GetDel().GetUid() != "late" {
		t.Fatalf("got %v", req)
	}
	p.ack("")
	if err := waitErr(t, done); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
}

// TestZ1NoHelloWithinTimeoutEndsConnection.
func TestZ1NoHelloWithinTimeoutEndsConnection(t *testing.T) {
	h := startServer(t, Config{HelloTimeout: 200 * time.Millisecond})
	p := dialRaw(t, h.path)
	p.expectClosed(2 * time.Second)
	h.logs.waitLine(t, "connection ended", "no hello within deadline")
}

// TestZ8IdleClosedConnectionIsDropped: an idle connection whose peer closes
// is noticed well within 5 s.
func TestZ8IdleClosedConnectionIsDropped(t *testing.T) {
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.handshake(0)
	testenv.Eventually(t, time.Second, "registered", func() bool { return h.srv.Connections() == 1 })
	time.Sleep(100 * time.Millisecond) // idle
	start := time.Now()
	_ = p.uc.Close()
	testenv.Eventually(t, 5*time.Second, "closed connection dropped", func() bool { return h.srv.Connections() == 0 })
	t.Logf("dropped after %v", time.Since(start))
	h.logs.waitLine(t, "ztunnel disconnected")
}

// OnHello is told the connected process (SO_PEERCRED) before the
// connection takes any pod; its error ends that connection unregistered,
// with no snapshot, and the next connection is asked again.
func TestOnHelloSeesThePeerAndCanRefuseIt(t *testing.T) {
	state := &pods{}
	state.set(Workload{UID: "known", Name: "k", Namespace: "default", ServiceAccount: "sa"})
	var mu sync.Mutex
	var seen []Peer
	refuse := true
	h := startServer(t, Config{Snapshot: state.snapshot, OnHello: func(p Peer) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, p)
		if refuse {
			refuse = false
			return errors.New("no programs for it")
		}
		return nil
	}})
	p1 := dialRaw(t, h.path)
	p1.hello()
	p1.expectClosed(2 * time.Second)
	if n := h.srv.Connections(); n != 0 {
		t.Errorf("a refused connection is registered: %d connections", n)
	}
	h.logs.waitLine(t, "refused: no programs for it")
	p2 := dialRaw(t, h.path)
	if got := uids(p2.handshake(1)); strings.Join(got, " ") != "keep:known" {
		t.Fatalf("snapshot after the refusal %v", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 || seen[0].PID != os.Getpid() || seen[1].PID != os.Getpid() || seen[0].UID != uint32(os.Getuid()) {
		t.Errorf("OnHello saw %+v; want this process (pid %d) twice", seen, os.Getpid())
	}
}
