// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/zdswire"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
)

// request is one live AddWorkload or DelWorkload handed to a connection.
type request struct {
	msg    *zdsapi.WorkloadRequest
	netns  string     // AddWorkload only: path whose descriptor travels along
	result chan error // buffered: the connection never blocks on it
}

func addRequest(w Workload) *request {
	return &request{msg: addMessage(w), netns: w.Netns, result: make(chan error, 1)}
}

func delRequest(uid string) *request {
	return &request{
		msg:    &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Del{Del: &zdsapi.DelWorkload{Uid: uid}}},
		result: make(chan error, 1),
	}
}

// addMessage always sets workload_info (Z5): current ztunnel treats a
// missing one as fatal.
func addMessage(w Workload) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{
		Uid: w.UID,
		WorkloadInfo: &zdsapi.WorkloadInfo{
			Name:           w.Name,
			Namespace:      w.Namespace,
			ServiceAccount: w.ServiceAccount,
		},
	}}}
}

func keepMessage(uid string) *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Keep{Keep: &zdsapi.KeepWorkload{Uid: uid}}}
}

func snapshotSentMessage() *zdsapi.WorkloadRequest {
	return &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_SnapshotSent{SnapshotSent: &zdsapi.SnapshotSent{}}}
}

// describe names a request for errors and logs.
func describe(m *zdsapi.WorkloadRequest) string {
	switch p := m.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		return "add " + p.Add.GetUid()
	case *zdsapi.WorkloadRequest_Keep:
		return "keep " + p.Keep.GetUid()
	case *zdsapi.WorkloadRequest_Del:
		return "del " + p.Del.GetUid()
	case *zdsapi.WorkloadRequest_SnapshotSent:
		return "snapshot_sent"
	default:
		return "unknown request"
	}
}

// inbound is one datagram (or read error) from ztunnel. Descriptors that
// came with it are already closed; nfds counts them.
type inbound struct {
	data []byte
	nfds int
	err  error
}

// conn is one ztunnel connection. Its serve goroutine owns the socket's
// write side and handles one request at a time; its reader owns the read
// side and is always waiting in recvmsg, which is what notices a closed
// peer while the connection is idle (Z8).
type conn struct {
	uc   *net.UnixConn
	id   uint64
	log  *slog.Logger
	reqs chan *request // unbuffered: a request is either taken or not
	in   chan inbound
	done chan struct{} // closed when the connection has ended

	// snapshotSent is set by the serve goroutine only.
	snapshotSent bool
}

func newConn(uc *net.UnixConn, id uint64, log *slog.Logger) *conn {
	return &conn{
		uc:   uc,
		id:   id,
		log:  log.With("conn", id),
		reqs: make(chan *request),
		in:   make(chan inbound),
		done: make(chan struct{}),
	}
}

// peer reads the connected process's credentials.
func (c *conn) peer() (Peer, error) {
	raw, err := c.uc.SyscallConn()
	if err != nil {
		return Peer{}, fmt.Errorf("peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Peer{}, fmt.Errorf("peer credentials: %w", err)
	}
	if credErr != nil {
		return Peer{}, fmt.Errorf("peer credentials (SO_PEERCRED): %w", credErr)
	}
	return Peer{PID: int(cred.Pid), UID: cred.Uid}, nil
}

// do hands r to the connection and waits for its outcome.
func (c *conn) do(ctx context.Context, r *request) error {
	select {
	case c.reqs <- r:
	case <-c.done:
		return ErrConnectionClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-r.result:
		return err
	case <-c.done:
		// The connection answers every request it took before it ends,
		// unless it ended in a recovered panic.
		select {
		case err := <-r.result:
			return err
		default:
			return ErrConnectionClosed
		}
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (c *conn) readLoop() {
	for {
		data, nfds, err := c.recv()
		select {
		case c.in <- inbound{data: data, nfds: nfds, err: err}:
		case <-c.done:
			return
		}
		if err != nil {
			return
		}
	}
}

// recv reads one datagram. ztunnel never sends descriptors, so any that
// came along are closed at once and only counted. A panic while reading
// or parsing what the peer sent becomes an error that ends only this
// connection.
func (c *conn) recv() (data []byte, nfds int, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = panicError("reading from ztunnel", r)
		}
	}()
	data, fds, err := zdswire.Recv(c.uc)
	zdswire.CloseAll(fds)
	return data, len(fds), err
}

// errPanic marks a connection ended by a recovered panic.
var errPanic = errors.New("panic")

// panicError turns a recovered value into an error carrying the stack.
func panicError(where string, r any) error {
	return fmt.Errorf("%w %s: %v\n%s", errPanic, where, r, debug.Stack())
}

// serveConn runs one connection from hello to its end and logs why it ended.
func (s *Server) serveConn(ctx context.Context, c *conn) {
	var reader sync.WaitGroup
	reader.Go(c.readLoop)
	err := s.safeSession(ctx, c)
	s.unregister(c)
	close(c.done)
	_ = c.uc.Close()
	reader.Wait()
	switch {
	case errors.Is(err, errPanic):
		c.log.Error("connection ended", "reason", err.Error())
	case ctx.Err() != nil && errors.Is(err, ctx.Err()):
		c.log.Info("connection closed: server stopping")
	case errors.Is(err, io.EOF) && c.snapshotSent:
		c.log.Info("connection ended: ztunnel disconnected", "reason", err.Error())
	default:
		c.log.Warn("connection ended", "reason", err.Error())
	}
}

// safeSession runs session and turns a panic in it into the reason the
// connection ends, so one peer cannot take the agent down.
func (s *Server) safeSession(ctx context.Context, c *conn) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = panicError("serving ztunnel", r)
		}
	}()
	return s.session(ctx, c)
}

// session speaks the protocol on c until it fails or ctx ends; it always
// returns the reason the connection ends.
func (s *Server) session(ctx context.Context, c *conn) error {
	// Z1: hello first, within HelloTimeout.
	in, err := c.next(ctx, time.Now().Add(s.cfg.HelloTimeout), "hello")
	if err != nil {
		return err
	}
	if in.nfds > 0 {
		return fmt.Errorf("hello carried %d file descriptors", in.nfds)
	}
	hello, err := zdswire.DecodeHello(in.data)
	if err != nil {
		return err
	}
	if s.cfg.OnHello != nil {
		peer, err := c.peer()
		if err != nil {
			return err
		}
		if err := s.cfg.OnHello(peer); err != nil {
			return fmt.Errorf("ztunnel (pid %d) refused: %w", peer.PID, err)
		}
	}
	// Register before reading the snapshot: a live change made from here
	// on queues on this connection, so none falls between the two (Z7).
	s.register(c)
	if v := hello.GetVersion(); v > zdsapi.Version_V1 {
		c.log.Info("ztunnel connected", "version", int32(v), "speaking", zdsapi.Version_V1.String())
	} else {
		c.log.Info("ztunnel connected", "version", v.String())
	}

	// Z2: the snapshot, one acked message at a time.
	for _, w := range s.cfg.Snapshot() {
		if err := s.sendSnapshotEntry(ctx, c, w); err != nil {
			return fmt.Errorf("during snapshot: %w", err)
		}
	}
	// Z3.
	if reqErr, connErr := c.exchange(ctx, snapshotSentMessage(), "", s.cfg.AckTimeout); connErr != nil {
		return fmt.Errorf("during snapshot: %w", connErr)
	} else if reqErr != nil {
		c.log.Warn("snapshot_sent rejected", "error", reqErr.Error())
	}
	c.snapshotSent = true
	c.log.Info("snapshot sent")

	// Z4: live requests, one in flight.
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case r := <-c.reqs:
			reqErr, connErr := c.exchange(ctx, r.msg, r.netns, s.cfg.AckTimeout)
			var bad *badAckError
			if errors.As(connErr, &bad) {
				// A malformed answer to a live request fails that request
				// and the connection stays, as upstream keeps it (Z6):
				// the datagram was read, so the next answer is the next
				// request's. A missing answer still ends the connection
				// (below): ZDS acks name no request, and a late one would
				// be taken as the answer to the next.
				c.log.Warn("malformed ack to a live request; connection kept", "error", connErr.Error())
				r.result <- connErr
				continue
			}
			if connErr != nil {
				r.result <- connErr
				return connErr
			}
			s.report(c, r.msg, false, reqErr)
			r.result <- reqErr
		case in := <-c.in:
			if in.err != nil {
				return in.err
			}
			return fmt.Errorf("unsolicited datagram while idle (%d bytes, %d file descriptors)", len(in.data), in.nfds)
		}
	}
}

// sendSnapshotEntry sends AddWorkload for w, or KeepWorkload when w's netns
// is unknown or cannot be opened any more. A NACK is logged and the
// snapshot goes on, as upstream does.
func (s *Server) sendSnapshotEntry(ctx context.Context, c *conn, w Workload) error {
	msg, netns := addMessage(w), w.Netns
	if netns == "" {
		msg = keepMessage(w.UID)
	}
	reqErr, connErr := c.exchange(ctx, msg, netns, s.cfg.AckTimeout)
	if connErr != nil {
		return connErr
	}
	var nsErr *netnsError
	if errors.As(reqErr, &nsErr) {
		c.log.Warn("netns unavailable; sending keep", "uid", w.UID, "error", reqErr.Error())
		msg = keepMessage(w.UID)
		reqErr, connErr = c.exchange(ctx, msg, "", s.cfg.AckTimeout)
		if connErr != nil {
			return connErr
		}
	}
	if reqErr != nil {
		c.log.Warn("snapshot entry rejected", "uid", w.UID, "error", reqErr.Error())
	}
	s.report(c, msg, true, reqErr)
	return nil
}

// report tells Config.OnAck ztunnel's answer to msg: an ack or a NACK. A
// request that never reached ztunnel (its netns could not be opened) is
// not an answer and is not reported.
func (s *Server) report(c *conn, msg *zdsapi.WorkloadRequest, snapshot bool, reqErr error) {
	if reqErr != nil && !errors.Is(reqErr, ErrNack) {
		return
	}
	a := Ack{Conn: c.id, Snapshot: snapshot, Err: reqErr}
	switch p := msg.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		a.Op, a.UID = OpAdd, p.Add.GetUid()
	case *zdsapi.WorkloadRequest_Keep:
		a.Op, a.UID = OpKeep, p.Keep.GetUid()
	case *zdsapi.WorkloadRequest_Del:
		a.Op, a.UID = OpDel, p.Del.GetUid()
	default:
		return
	}
	s.cfg.OnAck(a)
}

// netnsError: the netns of an AddWorkload could not be opened; nothing was
// sent, the connection is fine.
type netnsError struct{ err error }

func (e *netnsError) Error() string { return e.err.Error() }
func (e *netnsError) Unwrap() error { return e.err }

// badAckError: ztunnel answered, but not with a well-formed Ack (the
// datagram was read and its descriptors closed).
type badAckError struct{ err error }

func (e *badAckError) Error() string { return e.err.Error() }
func (e *badAckError) Unwrap() error { return e.err }

// exchange writes msg (with netns's descriptor when netns is set) and waits
// for its Ack, both before timeout (Z4). reqErr fails only this request (a
// NACK, an unopenable netns); connErr ends the connection.
func (c *conn) exchange(ctx context.Context, msg *zdsapi.WorkloadRequest, netns string, timeout time.Duration) (reqErr, connErr error) {
	what := describe(msg)
	var fds []int
	if netns != "" {
		fd, err := openNetns(netns)
		if err != nil {
			return &netnsError{fmt.Errorf("%s: %w", what, err)}, nil
		}
		defer unix.Close(fd)
		fds = []int{fd}
	}
	deadline := time.Now().Add(timeout)
	if err := c.uc.SetWriteDeadline(deadline); err != nil {
		return nil, fmt.Errorf("%s: set write deadline: %w", what, err)
	}
	if err := zdswire.Send(c.uc, msg, fds...); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	in, err := c.next(ctx, deadline, "ack for "+what)
	if err != nil {
		return nil, err
	}
	if in.nfds > 0 {
		return nil, &badAckError{fmt.Errorf("ack for %s carried %d file descriptors", what, in.nfds)}
	}
	ack, err := zdswire.DecodeResponse(in.data)
	if err != nil {
		return nil, &badAckError{fmt.Errorf("ack for %s: %w", what, err)}
	}
	if e := ack.GetError(); e != "" {
		return fmt.Errorf("%s: %w: %s", what, ErrNack, e), nil
	}
	return nil, nil
}

// next waits for the next datagram until deadline.
func (c *conn) next(ctx context.Context, deadline time.Time, what string) (inbound, error) {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case in := <-c.in:
		if in.err != nil {
			return in, fmt.Errorf("waiting for %s: %w", what, in.err)
		}
		return in, nil
	case <-t.C:
		return inbound{}, fmt.Errorf("no %s within deadline: %w", what, errTimeout)
	case <-ctx.Done():
		return inbound{}, ctx.Err()
	}
}

var errTimeout = errors.New("timeout")

// openNetns opens path and checks that it is a network namespace, so a
// wrong path fails here and not inside ztunnel.
func openNetns(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fdlimit.Annotate(fmt.Errorf("open netns %s: %w", path, err))
	}
	typ, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil || typ != unix.CLONE_NEWNET {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("%s is not a network namespace (type %#x): %w", path, typ, errors.Join(err, errNotNetns))
	}
	return fd, nil
}

var errNotNetns = errors.New("not a network namespace")
