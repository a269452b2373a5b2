// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zdsclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/zdswire"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// recorder is a Handler that reports every call as a line on events.
type recorder struct {
	tb     testing.TB
	events chan string
	mu     sync.Mutex
	fail   map[string]error        // uid -> error Add returns
	netns  map[string]nstest.Ident // uid -> identity of the netns Add got
}

func newRecorder(tb testing.TB) *recorder {
	return &recorder{tb: tb, events: make(chan string, 100), fail: map[string]error{}, netns: map[string]nstest.Ident{}}
}

func (r *recorder) Add(_ context.Context, uid string, info *zdsapi.WorkloadInfo, netns *os.File) error {
	r.mu.Lock()
	r.netns[uid] = nstest.IdentOfFD(r.tb, int(netns.Fd()))
	err := r.fail[uid]
	r.mu.Unlock()
	r.events <- fmt.Sprintf("add %s %s/%s sa=%s", uid, info.GetNamespace(), info.GetName(), info.GetServiceAccount())
	return err
}

func (r *recorder) Keep(_ context.Context, uid string) error {
	r.events <- "keep " + uid
	return nil
}

func (r *recorder) Del(_ context.Context, uid string) error {
	r.events <- "del " + uid
	return nil
}

func (r *recorder) SnapshotSent(_ context.Context, snapshot []string) error {
	r.events <- "snapshot_sent " + strings.Join(slices.Sorted(slices.Values(snapshot)), ",")
	return nil
}

func (r *recorder) expect(want ...string) {
	r.tb.Helper()
	for _, w := range want {
		select {
		case got := <-r.events:
			if got != w {
				r.tb.Fatalf("handler got %q, want %q", got, w)
			}
		case <-time.After(5 * time.Second):
			r.tb.Fatalf("handler never got %q", w)
		}
	}
}

func testLogger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tb.Output(), nil))
}

func runServer(tb testing.TB, path string, snapshot func() []zds.Workload) (*zds.Server, func()) {
	tb.Helper()
	srv, err := zds.NewServer(zds.Config{SocketPath: path, Snapshot: snapshot, HelloTimeout: time.Second, AckTimeout: time.Second, Logger: testLogger(tb)})
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	<-srv.Ready()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				tb.Errorf("server Run: %v", err)
			}
		})
	}
	tb.Cleanup(stop)
	return srv, stop
}

func runClient(tb testing.TB, cfg Config) {
	tb.Helper()
	cfg.Logger = testLogger(tb)
	c, err := New(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			tb.Errorf("client Run: %v", err)
		}
	})
}

// TestZ2Z5Z6ClientAgainstAgentServer runs the client against pkg/zds: the
// snapshot arrives as Add (with the pod's netns) and Keep, then
// SnapshotSent names both; live Add and Del reach the handler; a handler
// error comes back to the agent as a NACK with its text.
func TestZ2Z5Z6ClientAgainstAgentServer(t *testing.T) {
	nsA, nsC := nstest.NewNetns(t), nstest.NewNetns(t)
	path := filepath.Join(t.TempDir(), "zds.sock")
	srv, _ := runServer(t, path, func() []zds.Workload {
		return []zds.Workload{
			{UID: "a", Name: "pa", Namespace: "ns", ServiceAccount: "sa", Netns: nsA},
			{UID: "b", Name: "pb", Namespace: "ns", ServiceAccount: "sa"},
		}
	})
	rec := newRecorder(t)
	rec.fail["bad"] = errors.New("cannot open listeners in pod netns")
	runClient(t, Config{SocketPath: path, Handler: rec})

	rec.expect("add a ns/pa sa=sa", "keep b", "snapshot_sent a,b")
	rec.mu.Lock()
	if rec.netns["a"] != nstest.IdentOfPath(t, nsA) {
		t.Fatalf("add a got netns %+v, want %s", rec.netns["a"], nsA)
	}
	rec.mu.Unlock()

	ctx := context.Background()
	if err := srv.AddWorkload(ctx, zds.Workload{UID: "c", Name: "pc", Namespace: "ns2", ServiceAccount: "default", Netns: nsC}); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}
	rec.expect("add c ns2/pc sa=default")
	rec.mu.Lock()
	if rec.netns["c"] != nstest.IdentOfPath(t, nsC) {
		t.Fatalf("add c got netns %+v, want %s", rec.netns["c"], nsC)
	}
	rec.mu.Unlock()
	err := srv.AddWorkload(ctx, zds.Workload{UID: "bad", Netns: nsC})
	if !errors.Is(err, zds.ErrNack) || !strings.Contains(err.Error(), "cannot open listeners in pod netns") {
		t.Fatalf("AddWorkload with failing handler: %v", err)
	}
	rec.expect("add bad / sa=")
	if err := srv.DelWorkload(ctx, "c"); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
	rec.expect("del c")
}

// TestClientReconnectsAfterAgentRestart: when the agent goes away the
// client reconnects to the next agent on the same socket and receives its
// snapshot.
func TestClientReconnectsAfterAgentRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), "zds.sock")
	_, stop := runServer(t, path, func() []zds.Workload { return []zds.Workload{{UID: "one"}} })
	rec := newRecorder(t)
	ended := make(chan error, 10)
	runClient(t, Config{SocketPath: path, Handler: rec, MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		OnSessionEnd: func(err error) { ended <- err }})
	rec.expect("keep one", "snapshot_sent one")

	stop()
	select {
	case err := <-ended:
		t.Logf("session ended: %v", err)
	case <-time.After(5 * time.Second):
		t.Fatal("client did not notice the agent leaving")
	}
	runServer(t, path, func() []zds.Workload { return []zds.Workload{{UID: "two"}} })
	rec.expect("keep two", "snapshot_sent two")
}

// fakeAgent accepts one connection and lets the test script the agent side.
type fakeAgent struct {
	tb testing.TB
	uc *net.UnixConn
}

// serveFake runs ServeConn against a scripted agent and returns the agent
// end and the channel ServeConn's result arrives on.
func serveFake(t *testing.T, h Handler) (*fakeAgent, <-chan error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "fake.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.Close() })
	agent, err := l.AcceptUnix()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = agent.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	res := make(chan error, 1)
	go func() { res <- ServeConn(ctx, client, h, testLogger(t)) }()
	a := &fakeAgent{tb: t, uc: agent}
	data, fds, err := zdswire.Recv(agent)
	if err != nil || len(fds) != 0 {
		t.Fatalf("hello: %v, %d fds", err, len(fds))
	}
	if _, err := zdswire.DecodeHello(data); err != nil {
		t.Fatalf("client hello %x: %v", data, err)
	}
	return a, res
}

func (a *fakeAgent) send(m *zdsapi.WorkloadRequest, fds ...int) {
	a.tb.Helper()
	if err := zdswire.Send(a.uc, m, fds...); err != nil {
		a.tb.Fatal(err)
	}
}

func (a *fakeAgent) expectAck(wantErr string) {
	a.tb.Helper()
	_ = a.uc.SetReadDeadline(time.Now().Add(5 * time.Second))
	data, fds, err := zdswire.Recv(a.uc)
	if err != nil || len(fds) != 0 {
		a.tb.Fatalf("ack: %v, %d fds", err, len(fds))
	}
	var resp zdsapi.WorkloadResponse
	if err := proto.Unmarshal(data, &resp); err != nil || resp.GetAck() == nil {
		a.tb.Fatalf("ack %x: %v", data, err)
	}
	if got := resp.GetAck().GetError(); !strings.Contains(got, wantErr) || (wantErr == "") != (got == "") {
		a.tb.Fatalf("ack error %q, want %q", got, wantErr)
	}
}

func expectProtocolError(t *testing.T, res <-chan error, want string) {
	t.Helper()
	select {
	case err := <-res:
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), want) {
			t.Fatalf("session ended with %v, want protocol error %q", err, want)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("session did not end on %q", want)
	}
}

func snapshotSent() *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}
}

func keepX() *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: "x"}}}
}

func TestZ3SecondSnapshotSentIsAProtocolError(t *testing.T) {
	rec := newRecorder(t)
	a, res := serveFake(t, rec)
	a.send(snapshotSent())
	a.expectAck("")
	rec.expect("snapshot_sent ")
	a.send(snapshotSent())
	expectProtocolError(t, res, "second snapshot_sent")
}

func TestZ3KeepAfterSnapshotSentIsAProtocolError(t *testing.T) {
	rec := newRecorder(t)
	a, res := serveFake(t, rec)
	a.send(keepX())
	a.expectAck("")
	a.send(snapshotSent())
	a.expectAck("")
	rec.expect("keep x", "snapshot_sent x")
	a.send(keepX())
	expectProtocolError(t, res, "keep x after snapshot_sent")
}

// TestZ5DescriptorRulesAreEnforced: Add needs exactly one descriptor and
// workload_info; other requests must carry none. Every received descriptor
// is closed.
func TestZ5DescriptorRulesAreEnforced(t *testing.T) {
	fd := netnsFD(t)
	add := func(info *zdsapi.WorkloadInfo) *zdsapi.WorkloadRequest {
		return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{Uid: "x", WorkloadInfo: info}}}
	}
	info := &zdsapi.WorkloadInfo{Name: "n", Namespace: "ns", ServiceAccount: "sa"}
	cases := []struct {
		name string
		msg  *zdsapi.WorkloadRequest
		fds  []int
		want string
	}{
		{"add without descriptor", add(info), nil, "add x with 0 descriptors"},
		{"add with two descriptors", add(info), []int{fd, fd}, "add x with 2 descriptors"},
		{"add without workload_info", add(nil), []int{fd}, "workload_info set: false"},
		{"keep with a descriptor", keepX(), []int{fd}, "keep carried 1 descriptors"},
		{"unknown request (field 9)", nil, []int{fd}, "unknown message"},
	}
	before := nstest.CountFDs(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a, res := serveFake(t, newRecorder(t))
			if tc.msg == nil {
				if err := zdswire.SendRaw(a.uc, []byte{0x48, 0x01}, tc.fds...); err != nil {
					t.Fatal(err)
				}
			} else {
				a.send(tc.msg, tc.fds...)
			}
			expectProtocolError(t, res, tc.want)
		})
	}
	if after := nstest.CountFDs(t); after != before {
		t.Fatalf("descriptors: %d before, %d after", before, after)
	}
}

func TestNackTextIsTrimmedToOneDatagram(t *testing.T) {
	fd := netnsFD(t)
	rec := newRecorder(t)
	rec.fail["x"] = errors.New(strings.Repeat("é", 2000))
	a, _ := serveFake(t, rec)
	a.send(&zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{Uid: "x", WorkloadInfo: &zdsapi.WorkloadInfo{}}}}, fd)
	a.expectAck("é")
}

// netnsFD opens a throwaway netns; the descriptor is closed when the test ends.
func netnsFD(t *testing.T) int {
	t.Helper()
	f, err := os.Open(nstest.NewNetns(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Close() })
	return int(f.Fd())
}

// TestZ7TwoClientsDuringRollout: with an old and a new stand-in connected,
// the new one gets the full snapshot, Add reaches only the new one and Del
// reaches both.
func TestZ7TwoClientsDuringRollout(t *testing.T) {
	ns := nstest.NewNetns(t)
	path := filepath.Join(t.TempDir(), "zds.sock")
	srv, _ := runServer(t, path, func() []zds.Workload { return []zds.Workload{{UID: "a"}} })
	oldZ, newZ := newRecorder(t), newRecorder(t)
	runClient(t, Config{SocketPath: path, Handler: oldZ})
	oldZ.expect("keep a", "snapshot_sent a")
	runClient(t, Config{SocketPath: path, Handler: newZ})
	newZ.expect("keep a", "snapshot_sent a")

	ctx := context.Background()
	if err := srv.AddWorkload(ctx, zds.Workload{UID: "b", Name: "pb", Namespace: "ns", ServiceAccount: "sa", Netns: ns}); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}
	newZ.expect("add b ns/pb sa=sa")
	if err := srv.DelWorkload(ctx, "a"); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
	newZ.expect("del a")
	oldZ.expect("del a") // the old one got no add in between
}

// TestObserveSeesEachRequestAsItArrived: the transcript names each
// request's session, kind, uid, workload info, descriptors and the netns
// the descriptor names, in order, across a reconnect.
func TestObserveSeesEachRequestAsItArrived(t *testing.T) {
	nsA := nstest.NewNetns(t)
	path := filepath.Join(t.TempDir(), "zds.sock")
	srv, stop := runServer(t, path, func() []zds.Workload {
		return []zds.Workload{{UID: "a", Name: "pa", Namespace: "ns", ServiceAccount: "sa", Netns: nsA}, {UID: "b"}}
	})
	var mu sync.Mutex
	var seen []Observed
	rec := newRecorder(t)
	runClient(t, Config{SocketPath: path, Handler: rec, MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		Observe: func(o Observed) { mu.Lock(); seen = append(seen, o); mu.Unlock() }})
	rec.expect("add a ns/pa sa=sa", "keep b", "snapshot_sent a,b")
	if err := srv.DelWorkload(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	rec.expect("del a")
	stop()
	runServer(t, path, func() []zds.Workload { return nil })
	rec.expect("snapshot_sent ")

	id := nstest.IdentOfPath(t, nsA)
	want := []Observed{
		{Session: 1, Kind: "add", UID: "a", Info: true, Name: "pa", Namespace: "ns", ServiceAccount: "sa", FDs: 1, NetnsDev: id.Dev, NetnsIno: id.Ino},
		{Session: 1, Kind: "keep", UID: "b"},
		{Session: 1, Kind: "snapshot_sent"},
		{Session: 1, Kind: "del", UID: "a"},
		{Session: 2, Kind: "snapshot_sent"},
	}
	mu.Lock()
	defer mu.Unlock()
	for i := range seen {
		seen[i].Time = time.Time{}
	}
	if !slices.Equal(seen, want) {
		t.Fatalf("observed\n%+v\nwant\n%+v", seen, want)
	}
}
