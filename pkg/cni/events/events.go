// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package events is the CNI plugin's channel to the node agent: the agent's
// server, on a root-only unix socket, and the plugin's client. Both speak
// pkg/api/cniv1's frames, one request and one answer per connection; the
// agent implements Handler. This package owns the socket, the framing, the
// checks of every request before the handler sees it, and the mapping of
// handler errors to the codes the plugin tells apart. It links no gRPC, so
// the plugin, which runs on every pod start, starts fast.
package events

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

// DefaultSocketPath is where the agent listens and the plugin dials.
const DefaultSocketPath = "/var/run/ambient-ebpf/cni.sock"

// AddResult is the agent's answer to a pod ADD that it handled.
type AddResult struct {
	// Enrolled is true when the pod is redirected now, false when it is not
	// ambient and was left alone.
	Enrolled bool
	// Reason says why, for the plugin's log.
	Reason string
}

// Handler is what the agent implements. PodAdd must return only when the
// pod is redirected and ztunnel has it (or is known not to be ambient); any
// error fails the pod's CNI ADD. Wrap ErrNoZtunnel when no ztunnel is
// connected so the plugin can say so.
type Handler interface {
	PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (AddResult, error)
	PodDel(ctx context.Context, req *cniv1.PodDelRequest) error
}

// ErrNoZtunnel tells the plugin that enrollment failed because no ztunnel is
// connected to the agent.
var ErrNoZtunnel = errors.New("no ztunnel connected")

// Listen listens on socketPath with a socket only root can use from the
// moment it exists, creating its directory (0700) when missing. A stale
// socket left by a previous agent is replaced; anything else at the path
// (a live socket such as ztunnel's, a regular file, a directory) is
// refused and left alone (internal/unixsock).
func Listen(socketPath string) (net.Listener, error) {
	l, err := unixsock.Listen("unix", socketPath)
	if err != nil {
		return nil, err
	}
	return l, nil
}

// Serve listens on socketPath and serves h until ctx is cancelled.
func Serve(ctx context.Context, socketPath string, h Handler) error {
	ln, err := Listen(socketPath)
	if err != nil {
		return err
	}
	return ServeListener(ctx, ln, h)
}

const (
	// gracePeriod bounds how long in-flight calls may finish after ctx
	// ends.
	gracePeriod = 5 * time.Second
	// requestTimeout bounds the wait for a request once a connection is
	// accepted (the plugin writes it at once), answerTimeout the write of
	// the answer.
	requestTimeout = 10 * time.Second
	answerTimeout  = 5 * time.Second
	// maxMessage bounds an error's message in an answer, so that any
	// error fits a frame.
	maxMessage = 8 << 10
	// maxCallTimeout bounds the deadline a request may ask for (its
	// milliseconds would overflow a time.Duration long before int64).
	maxCallTimeout = time.Hour
)

// ServeListener serves h on ln until ctx is cancelled, then lets in-flight
// calls finish for a short grace period. It closes ln before it returns. A
// cancelled ctx is a clean stop and returns nil.
//
// Each connection carries one request: an ADD or DEL for h, or a probe,
// which the plugin's STATUS sends and which is answered while the agent
// serves. A frame this format refuses (malformed, oversized, of another
// version) is answered with an error naming why, logged, and the
// connection closed; a panic in a call fails that call, logged with its
// stack.
func ServeListener(ctx context.Context, ln net.Listener, h Handler, opts ...ServeOption) error {
	defer ln.Close()
	var o serveOptions
	for _, opt := range opts {
		opt(&o)
	}
	s := &server{h: h, log: slog.Default(), observe: o.observe}
	// Calls outlive ctx by the grace period: their contexts end only at
	// the hard stop after it.
	calls, hardStop := context.WithCancel(context.WithoutCancel(ctx))
	defer hardStop()
	stopAccepting := context.AfterFunc(ctx, func() {
		s.stopping.Store(true)
		_ = ln.Close()
	})
	defer stopAccepting()

	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns = map[net.Conn]struct{}{}
	)
	serveErr := s.accept(ctx, ln, func(c net.Conn) {
		mu.Lock()
		conns[c] = struct{}{}
		mu.Unlock()
		wg.Go(func() {
			defer func() {
				mu.Lock()
				delete(conns, c)
				mu.Unlock()
			}()
			s.serveConn(calls, c)
		})
	})
	drained := make(chan struct{})
	go func() { wg.Wait(); close(drained) }()
	select {
	case <-drained:
	case <-time.After(gracePeriod):
		hardStop()
		mu.Lock()
		for c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		<-drained
	}
	if ctx.Err() != nil {
		return nil
	}
	if serveErr != nil {
		return fmt.Errorf("serve cni events on %s: %w", ln.Addr(), serveErr)
	}
	return nil
}

// accept hands each connection to serve until ln is closed, retrying
// after a temporary error (too many open files) with a growing pause.
func (s *server) accept(ctx context.Context, ln net.Listener, serve func(net.Conn)) error {
	var pause time.Duration
	for {
		c, err := ln.Accept()
		if err == nil {
			pause = 0
			serve(c)
			continue
		}
		var temp interface{ Temporary() bool }
		if ctx.Err() != nil || !errors.As(err, &temp) || !temp.Temporary() {
			return err
		}
		pause = min(max(2*pause, 5*time.Millisecond), time.Second)
		s.log.Warn("accept on the cni socket failed, retrying", "error", err, "pause", pause)
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return nil
		}
	}
}

// ServeOption configures ServeListener.
type ServeOption func(*serveOptions)

type serveOptions struct {
	observe func(method string, code cniv1.Code)
}

// WithObserver has observe told, for each PodAdd ("add") and PodDel ("del")
// the server answers, the code of its answer (cniv1.CodeOK on success):
// CodeInvalidArgument for a request refused as malformed, CodeInternal for
// a handler that panicked, the code of the handler's error otherwise. It
// must not block.
func WithObserver(observe func(method string, code cniv1.Code)) ServeOption {
	return func(o *serveOptions) { o.observe = observe }
}

type server struct {
	h        Handler
	log      *slog.Logger
	observe  func(method string, code cniv1.Code)
	stopping atomic.Bool
}

// serveConn reads one request from c, answers it and closes c. calls is
// the parent of the call's context, which also ends when the plugin hangs
// up (it timed out or was killed) or its deadline passes.
func (s *server) serveConn(calls context.Context, c net.Conn) {
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(requestTimeout))
	kind, req, err := cniv1.ReadRequest(c)
	if err != nil {
		code := cniv1.CodeInvalidArgument
		switch {
		case errors.Is(err, cniv1.ErrVersion):
			code = cniv1.CodeUnsupportedVersion
		case errors.Is(err, cniv1.ErrMalformed):
		case errors.Is(err, io.EOF):
			return // nothing arrived: no one to answer
		default:
			s.log.Warn("cni request not read", "error", err)
			return
		}
		s.log.Warn("cni request refused", "error", err)
		s.observed(kind, code)
		s.answer(c, kind, nil, &cniv1.Error{Code: code, Message: err.Error()})
		return
	}
	ctx, cancel := context.WithCancel(calls)
	defer cancel()
	if req.TimeoutMillis > 0 {
		var cancelT context.CancelFunc
		ms := min(req.TimeoutMillis, maxCallTimeout.Milliseconds())
		ctx, cancelT = context.WithTimeout(ctx, time.Duration(ms)*time.Millisecond)
		defer cancelT()
	}
	// One request per connection: anything the plugin does next, hanging
	// up included, cancels the call.
	_ = c.SetReadDeadline(time.Time{})
	go func() {
		var b [1]byte
		_, _ = c.Read(b[:])
		cancel()
	}()
	var result any
	switch kind {
	case cniv1.KindAdd:
		result, err = s.call(ctx, "PodAdd", func() (any, error) {
			return s.PodAdd(ctx, &cniv1.PodAddRequest{Pod: req.Pod, Ips: req.Ips})
		})
	case cniv1.KindDel:
		result, err = s.call(ctx, "PodDel", func() (any, error) {
			return s.PodDel(ctx, &cniv1.PodDelRequest{Pod: req.Pod})
		})
	case cniv1.KindProbe:
		if s.stopping.Load() {
			err = &cniv1.Error{Code: cniv1.CodeUnavailable, Message: "the agent is stopping"}
		}
	}
	s.observed(kind, codeOf(err))
	s.answer(c, kind, result, err)
}

// call runs f, turning a panic into an internal error for this call only.
func (s *server) call(ctx context.Context, method string, f func() (any, error)) (resp any, err error) {
	defer func() {
		if r := recover(); r != nil {
			s.log.ErrorContext(ctx, "cni handler panicked", "method", method, "panic", r, "stack", string(debug.Stack()))
			resp, err = nil, &cniv1.Error{Code: cniv1.CodeInternal, Message: fmt.Sprintf("%s panicked: %v", method, r)}
		}
	}()
	return f()
}

func (s *server) observed(kind cniv1.Kind, code cniv1.Code) {
	if s.observe == nil {
		return
	}
	switch kind {
	case cniv1.KindAdd:
		s.observe("add", code)
	case cniv1.KindDel:
		s.observe("del", code)
	}
}

// answer writes the result, or err as an error frame, to c.
func (s *server) answer(c net.Conn, kind cniv1.Kind, result any, err error) {
	_ = c.SetWriteDeadline(time.Now().Add(answerTimeout))
	var werr error
	if err != nil {
		e := asError(err)
		if len(e.Message) > maxMessage {
			e = &cniv1.Error{Code: e.Code, Message: e.Message[:maxMessage] + "..."}
		}
		werr = cniv1.WriteFrame(c, cniv1.KindError, e)
	} else {
		if result == nil {
			result = struct{}{}
		}
		werr = cniv1.WriteFrame(c, cniv1.KindResult, result)
	}
	if werr != nil {
		s.log.Warn("cni answer not delivered", "request", kind.String(), "error", werr)
	}
}

func (s *server) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	if err := validAdd(req); err != nil {
		s.log.WarnContext(ctx, "cni add refused", "error", err)
		return nil, &cniv1.Error{Code: cniv1.CodeInvalidArgument, Message: err.Error()}
	}
	res, err := s.h.PodAdd(ctx, req)
	if err != nil {
		p := req.GetPod()
		s.log.WarnContext(ctx, "cni add failed", "pod", p.GetNamespace()+"/"+p.GetName(), "error", err)
		return nil, toStatus(err)
	}
	return &cniv1.PodAddResponse{Enrolled: res.Enrolled, Reason: res.Reason}, nil
}

func (s *server) PodDel(ctx context.Context, req *cniv1.PodDelRequest) (any, error) {
	if err := validPod(req.GetPod(), false); err != nil {
		s.log.WarnContext(ctx, "cni del refused", "error", err)
		return nil, &cniv1.Error{Code: cniv1.CodeInvalidArgument, Message: err.Error()}
	}
	if err := s.h.PodDel(ctx, req); err != nil {
		return nil, toStatus(err)
	}
	return nil, nil
}

// validAdd checks an ADD: the pod (validPod) and its addresses, which must
// be IPs without a zone.
func validAdd(req *cniv1.PodAddRequest) error {
	if err := validPod(req.GetPod(), true); err != nil {
		return err
	}
	for _, s := range req.GetIps() {
		if a, err := netip.ParseAddr(s); err != nil || a.Zone() != "" {
			return fmt.Errorf("invalid pod ip %q", s)
		}
	}
	return nil
}

// validPod refuses, naming the field and the value, a pod whose identities
// fail pkg/validate's checks; the server answers CodeInvalidArgument. An
// ADD needs the pod's namespace, name and netns; a DEL only something to
// find the pod by (uid, container id, netns, or namespace and name). Every
// field given is checked.
func validPod(p *cniv1.Pod, add bool) error {
	var checks []error
	switch {
	case p.GetNamespace() != "" || p.GetName() != "" || add:
		checks = append(checks, validate.PodNames(p.GetNamespace(), p.GetName()))
	case p.GetUid() == "" && p.GetContainerId() == "" && p.GetNetns() == "":
		return errors.New("pod uid, container id, netns or namespace and name required")
	}
	if p.GetUid() != "" {
		checks = append(checks, validate.PodUID(p.GetUid()))
	}
	if p.GetContainerId() != "" {
		checks = append(checks, validate.ContainerID(p.GetContainerId()))
	}
	if p.GetNetns() != "" || add {
		checks = append(checks, validate.NetnsPath(p.GetNetns()))
	}
	if p.GetInterface() != "" {
		checks = append(checks, validate.Interface(p.GetInterface()))
	}
	return errors.Join(checks...)
}

// toStatus maps a handler error to a code the plugin tells apart: no
// ztunnel, the caller's deadline passed (a timeout, like one of the
// socket's), or the agent could not enroll.
func toStatus(err error) *cniv1.Error {
	code := cniv1.CodeInternal
	switch {
	case errors.Is(err, ErrNoZtunnel):
		code = cniv1.CodeNoZtunnel
	case errors.Is(err, context.DeadlineExceeded):
		// The caller's deadline (it travels with the call) passed while
		// the agent worked: for the plugin that is a timeout, whose
		// fallback then decides, not a refusal. As an enrollment failure
		// it could reach the plugin before its own deadline fired and
		// fail a pod that is not ambient.
		code = cniv1.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = cniv1.CodeCanceled
	}
	return &cniv1.Error{Code: code, Message: err.Error()}
}

// asError is err as an answer: a *cniv1.Error as it is, anything else
// internal.
func asError(err error) *cniv1.Error {
	if e, ok := errors.AsType[*cniv1.Error](err); ok {
		return e
	}
	return &cniv1.Error{Code: cniv1.CodeInternal, Message: err.Error()}
}

// codeOf is the code of the answer err gives (CodeOK for nil).
func codeOf(err error) cniv1.Code {
	if err == nil {
		return cniv1.CodeOK
	}
	return asError(err).Code
}
