// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/internal/zdswire"
)

// logSink keeps every log line so tests can wait for a logged reason.
type logSink struct {
	mu    sync.Mutex
	lines []string
	tb    testing.TB
}

func (l *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (l *logSink) WithGroup(string) slog.Handler            { return l }
func (l *logSink) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrSink{sink: l, attrs: as}
}
func (l *logSink) Handle(_ context.Context, r slog.Record) error { return l.add(r, nil) }

func (l *logSink) add(r slog.Record, pre []slog.Attr) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s", r.Level, r.Message)
	for _, a := range pre {
		fmt.Fprintf(&b, " %s", a)
	}
	r.Attrs(func(a slog.Attr) bool { fmt.Fprintf(&b, " %s", a); return true })
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, b.String())
	return nil
}

type attrSink struct {
	sink  *logSink
	attrs []slog.Attr
}

func (a *attrSink) Enabled(context.Context, slog.Level) bool { return true }
func (a *attrSink) WithGroup(string) slog.Handler            { return a }
func (a *attrSink) WithAttrs(as []slog.Attr) slog.Handler {
	return &attrSink{sink: a.sink, attrs: append(append([]slog.Attr(nil), a.attrs...), as...)}
}
func (a *attrSink) Handle(_ context.Context, r slog.Record) error { return a.sink.add(r, a.attrs) }

// waitLine waits until a log line contains every one of subs.
func (l *logSink) waitLine(tb testing.TB, subs ...string) string {
	tb.Helper()
	var found string
	testenv.Eventually(tb, 5*time.Second, fmt.Sprintf("log line with %q", subs), func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
	lines:
		for _, line := range l.lines {
			for _, s := range subs {
				if !strings.Contains(line, s) {
					continue lines
				}
			}
			found = line
			return true
		}
		return false
	})
	return found
}

func (l *logSink) dump() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// harness is one running Server on a socket in a temp dir.
type harness struct {
	srv  *Server
	path string
	logs *logSink
	stop func()
}

// startServer runs a Server until the test ends. cfg.SocketPath defaults to
// a fresh temp dir; timeouts default to test-friendly values.
func startServer(tb testing.TB, cfg Config) *harness {
	tb.Helper()
	if cfg.SocketPath == "" {
		cfg.SocketPath = filepath.Join(tb.TempDir(), "zds.sock")
	}
	if cfg.HelloTimeout == 0 {
		cfg.HelloTimeout = 2 * time.Second
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = 2 * time.Second
	}
	logs := &logSink{tb: tb}
	cfg.Logger = slog.New(logs)
	srv, err := NewServer(cfg)
	if err != nil {
		tb.Fatalf("NewServer: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	select {
	case <-srv.Ready():
	case err := <-done:
		cancel()
		tb.Fatalf("Run returned before ready: %v", err)
	}
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				tb.Errorf("Run: %v", err)
			}
		})
	}
	tb.Cleanup(func() {
		stop()
		if tb.Failed() {
			tb.Logf("server log:\n%s", logs.dump())
		}
	})
	return &harness{srv: srv, path: cfg.SocketPath, logs: logs, stop: stop}
}

// rawPeer is a hand-driven ztunnel: it writes bytes encoded with Istio's
// published types and reads every datagram raw.
type rawPeer struct {
	tb  testing.TB
	uc  *net.UnixConn
	fds []int // every descriptor received, closed by releaseFDs
}

func dialRaw(tb testing.TB, path string) *rawPeer {
	tb.Helper()
	uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		tb.Fatalf("dial %s: %v", path, err)
	}
	p := &rawPeer{tb: tb, uc: uc}
	tb.Cleanup(func() {
		_ = uc.Close()
		p.releaseFDs()
	})
	return p
}

// releaseFDs closes every descriptor received so far.
func (p *rawPeer) releaseFDs() {
	zdswire.CloseAll(p.fds)
	p.fds = nil
}

func (p *rawPeer) sendBytes(b []byte, fds ...int) {
	p.tb.Helper()
	if err := zdswire.SendRaw(p.uc, b, fds...); err != nil {
		p.tb.Fatalf("send: %v", err)
	}
}

func (p *rawPeer) sendMsg(m proto.Message) {
	p.tb.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		p.tb.Fatalf("marshal: %v", err)
	}
	p.sendBytes(b)
}

func (p *rawPeer) hello() {
	p.tb.Helper()
	p.sendMsg(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
}

func (p *rawPeer) ack(errText string) {
	p.tb.Helper()
	p.sendMsg(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: errText}}})
}

// datagram is one raw datagram from the server.
type datagram struct {
	data []byte
	fds  []int
}

// recvRaw reads one datagram within d; its fds are closed by releaseFDs.
func (p *rawPeer) recvRaw(d time.Duration) (datagram, error) {
	_ = p.uc.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(16*4))
	n, oobn, flags, _, err := p.uc.ReadMsgUnix(buf, oob)
	fds, perr := zdswire.ParseRights(oob[:oobn])
	p.fds = append(p.fds, fds...)
	if err = errors.Join(err, perr); err != nil {
		return datagram{}, err
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		return datagram{}, fmt.Errorf("truncated datagram, flags %#x", flags)
	}
	return datagram{data: buf[:n], fds: fds}, nil
}

// recv reads and decodes one request with Istio's WorkloadRequest type.
func (p *rawPeer) recv() (*zdsapi.WorkloadRequest, datagram) {
	p.tb.Helper()
	d, err := p.recvRaw(3 * time.Second)
	if err != nil {
		p.tb.Fatalf("recv: %v", err)
	}
	var req zdsapi.WorkloadRequest
	if err := proto.Unmarshal(d.data, &req); err != nil {
		p.tb.Fatalf("decode %x with zdsapi.WorkloadRequest: %v", d.data, err)
	}
	return &req, d
}

// expectNothing checks that no datagram arrives within d.
func (p *rawPeer) expectNothing(d time.Duration) {
	p.tb.Helper()
	got, err := p.recvRaw(d)
	if err == nil {
		p.tb.Fatalf("unexpected datagram %x", got.data)
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		p.tb.Fatalf("expected silence, got %v", err)
	}
}

// expectClosed checks that the server closes the connection within d.
func (p *rawPeer) expectClosed(d time.Duration) {
	p.tb.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		_, err := p.recvRaw(time.Until(deadline))
		if err == nil {
			continue // drain whatever was in flight
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			break
		}
		return // EOF or reset: closed
	}
	p.tb.Fatalf("connection still open after %v", d)
}

// handshake says hello and acks a snapshot of n entries plus SnapshotSent,
// returning the entries.
func (p *rawPeer) handshake(n int) []*zdsapi.WorkloadRequest {
	p.tb.Helper()
	p.hello()
	var got []*zdsapi.WorkloadRequest
	for range n {
		req, _ := p.recv()
		got = append(got, req)
		p.ack("")
	}
	req, _ := p.recv()
	if req.GetSnapshotSent() == nil {
		p.tb.Fatalf("expected snapshot_sent after %d entries, got %v", n, req)
	}
	p.ack("")
	return got
}

// doAsync runs f in a goroutine and returns its result channel.
func doAsync(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

func waitErr(tb testing.TB, ch <-chan error) error {
	tb.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(5 * time.Second):
		tb.Fatal("call did not return")
		return nil
	}
}

// delThrough calls DelWorkload and checks that each peer receives it,
// acks it, and that the call succeeds.
func (h *harness) delThrough(tb testing.TB, uid string, peers ...*rawPeer) {
	tb.Helper()
	done := doAsync(func() error { return h.srv.DelWorkload(context.Background(), uid) })
	for _, p := range peers {
		if req, _ := p.recv(); req.GetDel().GetUid() != uid {
			tb.Fatalf("got %v, want del %s", req, uid)
		}
		p.ack("")
	}
	if err := waitErr(tb, done); err != nil {
		tb.Fatalf("DelWorkload %s: %v", uid, err)
	}
}
