// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package zds is the agent side of ZDS, the protocol that hands enrolled pods
// and their network namespaces to ztunnel (contract section 4, rows Z1-Z9).
//
// The agent listens on a SOCK_SEQPACKET unix socket; ztunnel connects. The
// wire messages are Istio's published Go types (istio.io/istio/pkg/zdsapi),
// one protobuf per datagram of at most 1024 bytes, the netns travelling as
// one SCM_RIGHTS descriptor with AddWorkload.
//
// API:
//
//	func NewServer(cfg Config) (*Server, error)           // validates, no I/O
//	func (s *Server) Run(ctx context.Context) error       // listen and serve until ctx is done
//	func (s *Server) Ready() <-chan struct{}               // closed once listening
//	func (s *Server) AddWorkload(ctx context.Context, w Workload) error
//	func (s *Server) DelWorkload(ctx context.Context, uid string) error
//	func (s *Server) Connections() int
//
// Per connection: ztunnel must send ZdsHello within Config.HelloTimeout
// (Z1); any version from V1 on is accepted and logged, as istio-cni does,
// so a newer ztunnel still connects. At most AcceptRate connections are
// accepted a second (Z10). The connection then becomes the newest one and receives the
// snapshot from Config.Snapshot: AddWorkload with the netns descriptor, or
// KeepWorkload when the netns is unknown (Z2), then SnapshotSent (Z3). Live
// AddWorkload and DelWorkload follow, strictly one in flight per connection,
// each with a write + ack deadline of Config.AckTimeout (Z4). An Ack with a
// non-empty error is a NACK: the call fails with ErrNack and the connection
// stays (Z6); so does a malformed answer to a live request, which fails
// only that call. A missing answer ends the connection: ZDS acks carry no
// request id, so a late one would be read as the next request's.
// Every answer is reported to Config.OnAck. AddWorkload goes to the newest connection only, DelWorkload to
// every connection (Z7). Requests issued while a connection is still sending
// its snapshot queue behind it; the connection is registered before the
// snapshot is read, so no live change can fall between the two.
//
// Callers keep the pod state that Config.Snapshot reads and update it before
// calling AddWorkload or DelWorkload. Then a connection that registers at
// any moment either finds the change in its snapshot or receives it live
// (or both: a repeated Add for the same netns is harmless to ztunnel, Z9).
//
// Liveness (Z8): every connection has a reader that is always blocked in
// recvmsg, so a peer that closes is noticed at once, idle or not. A datagram
// ztunnel sends when no request is in flight is a protocol error.
//
// Bad input from a peer (a datagram over 1024 bytes, an undecodable or
// unknown message, a response carrying descriptors, no hello in time, a
// disconnect mid-snapshot, an ack timeout) ends only that connection, logged
// with its reason. The server holds no pod state of its own (the snapshot
// comes from the caller each time), so nothing is lost with a connection.
package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
)

// DefaultSocketPath is where ztunnel looks for the agent.
const DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"

// AcceptRate is how many new connections a second the server accepts at
// most (Z10).
const AcceptRate = 5

// Default timeouts (Z1, Z4).
const (
	DefaultHelloTimeout = 5 * time.Second
	DefaultAckTimeout   = 5 * time.Second
)

var (
	// ErrNoZtunnel is returned by AddWorkload when no ztunnel is connected.
	ErrNoZtunnel = errors.New("no ztunnel connected")
	// ErrNack wraps the text of an Ack with a non-empty error.
	ErrNack = errors.New("ztunnel rejected the request")
	// ErrConnectionClosed: the connection ended before the request completed.
	ErrConnectionClosed = errors.New("ztunnel connection closed")
)

// Workload is one enrolled pod as ztunnel sees it.
type Workload struct {
	UID            string // pod UID
	Name           string // pod name
	Namespace      string // pod namespace
	ServiceAccount string // spec.serviceAccountName
	// Netns is the path of the pod's network namespace (for example
	// /proc/<pid>/ns/net or /var/run/netns/<name>). In a snapshot an empty
	// or unopenable path sends KeepWorkload instead of AddWorkload.
	Netns string
}

// Config configures a Server. Zero values take the defaults.
type Config struct {
	// SocketPath is the unix socket to listen on; DefaultSocketPath if empty.
	SocketPath string
	// Snapshot returns the enrolled pods; it is called once per new
	// connection, after hello. Nil means no pods.
	Snapshot func() []Workload
	// Logger receives connection events; slog.Default() if nil.
	Logger *slog.Logger
	// HelloTimeout bounds the wait for ZdsHello (Z1).
	HelloTimeout time.Duration
	// AckTimeout bounds the write and ack of every request (Z4).
	AckTimeout time.Duration
	// OnAck, when set, is told every answer ztunnel gives to an
	// AddWorkload, KeepWorkload or DelWorkload, live or in a snapshot:
	// the event that turns a pending pod enabled, or a NACK to retry. It
	// is called on the connection's goroutine before the call that sent
	// the request returns, so it must not block or call the Server.
	OnAck func(Ack)
	// OnHello, when set, is told who connected once ztunnel said hello,
	// before the connection is registered or sent its snapshot: no pod
	// reaches that ztunnel before it returns. An error ends the
	// connection (ztunnel connects again). It runs on the connection's
	// goroutine and must not call the Server.
	OnHello func(Peer) error
	// OnConnections, when set, is told the number of connections each
	// time one registers or ends. It must not block or call the Server.
	OnConnections func(n int)
}

// Peer is the process at the other end of a connection, from the
// socket's credentials (SO_PEERCRED), PIDs as this process's PID
// namespace numbers them (0 when the peer's is not visible from it).
type Peer struct {
	PID int
	UID uint32
}

// Op names the request an Ack answers.
type Op string

const (
	OpAdd  Op = "add"
	OpKeep Op = "keep"
	OpDel  Op = "del"
)

// Ack is ztunnel's answer to one request about one pod (Config.OnAck).
type Ack struct {
	Conn     uint64 // the connection, numbered from 1 in accept order
	UID      string // the pod
	Op       Op
	Snapshot bool  // sent as part of the connection's snapshot (Z2)
	Err      error // nil: acked; wraps ErrNack: rejected (Z6)
}

// Server is the agent's ZDS endpoint. Create it with NewServer and start it
// with Run; the other methods are safe for concurrent use.
type Server struct {
	cfg   Config
	log   *slog.Logger
	ready chan struct{}

	mu    sync.Mutex
	conns []*conn // registered (hello received), oldest first
	ran   bool
}

// NewServer validates cfg and fills in defaults. It does no I/O.
func NewServer(cfg Config) (*Server, error) {
	if cfg.SocketPath == "" {
		cfg.SocketPath = DefaultSocketPath
	}
	if !filepath.IsAbs(cfg.SocketPath) {
		return nil, fmt.Errorf("socket path %q is not absolute", cfg.SocketPath)
	}
	if cfg.HelloTimeout < 0 || cfg.AckTimeout < 0 {
		return nil, fmt.Errorf("negative timeout (hello %v, ack %v)", cfg.HelloTimeout, cfg.AckTimeout)
	}
	if cfg.HelloTimeout == 0 {
		cfg.HelloTimeout = DefaultHelloTimeout
	}
	if cfg.AckTimeout == 0 {
		cfg.AckTimeout = DefaultAckTimeout
	}
	if cfg.Snapshot == nil {
		cfg.Snapshot = func() []Workload { return nil }
	}
	if cfg.OnAck == nil {
		cfg.OnAck = func(Ack) {}
	}
	if cfg.OnConnections == nil {
		cfg.OnConnections = func(int) {}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Server{
		cfg:   cfg,
		log:   log.With("component", "zds", "socket", cfg.SocketPath),
		ready: make(chan struct{}),
	}, nil
}

// Ready is closed once Run listens on the socket.
func (s *Server) Ready() <-chan struct{} { return s.ready }

// Connections returns the number of ztunnel connections that said hello
// and have not ended.
func (s *Server) Connections() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// Run listens and serves connections until ctx is done. It replaces a
// stale socket file at the path but refuses anything else there, a socket
// another listener answers on included; the socket is 0600 from the
// moment it appears, so only root can connect (internal/unixsock). When
// ctx is done it closes every connection, removes the socket file (unless
// it is no longer this server's) and returns nil. Run may be called once.
func (s *Server) Run(ctx context.Context) error {
	s.mu.Lock()
	if s.ran {
		s.mu.Unlock()
		return errors.New("zds server already ran")
	}
	s.ran = true
	s.mu.Unlock()

	l, err := unixsock.Listen("unixpacket", s.cfg.SocketPath)
	if err != nil {
		return err
	}
	// Close is called twice, here and on cancellation; each call returns
	// only once the listener is closed, so Run never returns with it open.
	defer l.Close()
	s.log.Info("listening")
	close(s.ready)

	// Connections live in a context of their own so that an accept failure
	// ends them too.
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	stop := context.AfterFunc(ctx, func() { _ = l.Close() })
	defer stop()
	backoff := time.Duration(0)
	// At most AcceptRate new connections a second (Z10), as istio-cni: a
	// ztunnel reconnecting in a loop cannot make the agent spin.
	accepts := rate.NewLimiter(AcceptRate, 1)
	for id := uint64(1); ; id++ {
		if err := accepts.Wait(ctx); err != nil {
			return nil // ctx ended
		}
		uc, err := l.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return fmt.Errorf("accept on %s: %w", s.cfg.SocketPath, err)
			}
			// EMFILE and the like pass; retry like net/http does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			s.log.Error("accept failed; retrying", "error", err.Error(), "backoff", backoff)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		c := newConn(uc, id, s.log)
		wg.Go(func() { s.serveConn(ctx, c) })
	}
}

// AddWorkload sends AddWorkload with w's netns to the newest connection and
// waits for its Ack (Z4, Z5, Z7). It returns ErrNoZtunnel when none is
// connected and an error wrapping ErrNack with ztunnel's text on a NACK. If
// ctx ends after the request was handed to the connection, the request may
// still reach ztunnel.
func (s *Server) AddWorkload(ctx context.Context, w Workload) error {
	if w.UID == "" {
		return errors.New("add workload: empty uid")
	}
	if w.Netns == "" {
		return fmt.Errorf("add workload %s: empty netns path", w.UID)
	}
	s.mu.Lock()
	var c *conn
	if n := len(s.conns); n > 0 {
		c = s.conns[n-1]
	}
	s.mu.Unlock()
	if c == nil {
		return fmt.Errorf("add workload %s: %w", w.UID, ErrNoZtunnel)
	}
	if err := c.do(ctx, addRequest(w)); err != nil {
		return fmt.Errorf("add workload %s: %w", w.UID, err)
	}
	return nil
}

// DelWorkload sends DelWorkload to every connection and waits for every Ack
// (Z7); the error joins the failures of each connection. With no connection
// it returns nil: the pod will be absent from the next snapshot, which makes
// ztunnel drop it (Z3).
func (s *Server) DelWorkload(ctx context.Context, uid string) error {
	if uid == "" {
		return errors.New("del workload: empty uid")
	}
	s.mu.Lock()
	conns := append([]*conn(nil), s.conns...)
	s.mu.Unlock()
	errs := make([]error, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Go(func() {
			// A connection that ended before taking the request needs no
			// Del: its ztunnel gets a fresh snapshot when it reconnects.
			if err := c.do(ctx, delRequest(uid)); err != nil && !errors.Is(err, ErrConnectionClosed) {
				errs[i] = fmt.Errorf("connection %d: %w", c.id, err)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("del workload %s: %w", uid, err)
	}
	return nil
}

func (s *Server) register(c *conn) {
	s.mu.Lock()
	s.conns = append(s.conns, c)
	n := len(s.conns)
	s.mu.Unlock()
	s.cfg.OnConnections(n)
}

func (s *Server) unregister(c *conn) {
	s.mu.Lock()
	found := false
	for i := range s.conns {
		if s.conns[i] == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			found = true
			break
		}
	}
	n := len(s.conns)
	s.mu.Unlock()
	if found {
		s.cfg.OnConnections(n)
	}
}
