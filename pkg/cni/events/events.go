// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package events is the agent's end of the CNI plugin channel: a gRPC
// server for the cniv1.CNIEvents service on a root-only unix socket. The
// agent implements Handler; this package owns the socket, the transport and
// the mapping of handler errors to gRPC status codes the plugin understands.
package events

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"runtime/debug"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

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

// gracePeriod bounds how long in-flight calls may finish after ctx ends.
const gracePeriod = 5 * time.Second

// ServeListener serves h on ln until ctx is cancelled, then lets in-flight
// calls finish for a short grace period. It closes ln before it returns. A
// cancelled ctx is a clean stop and returns nil.
//
// Besides the CNIEvents service it serves the standard gRPC health service,
// which the plugin's STATUS asks (Probe), and it recovers a panic in any
// call into an Internal error, logged with its stack.
func ServeListener(ctx context.Context, ln net.Listener, h Handler, opts ...ServeOption) error {
	defer ln.Close()
	var o serveOptions
	for _, opt := range opts {
		opt(&o)
	}
	// The observer sits outside the recovery, so a panicked call counts
	// with the Internal error it answers.
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(o.observer(), RecoverUnary(slog.Default())))
	cniv1.RegisterCNIEventsServer(srv, &server{h: h, log: slog.Default()})
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		hs.Shutdown()
		stopped := make(chan struct{})
		go func() { srv.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(gracePeriod):
			srv.Stop()
		}
	}()
	err := srv.Serve(ln)
	if ctx.Err() != nil {
		<-done
		return nil
	}
	srv.Stop()
	if err != nil {
		return fmt.Errorf("serve cni events on %s: %w", ln.Addr(), err)
	}
	return nil
}

// RecoverUnary is a gRPC interceptor that turns a panic in a handler into
// an Internal error for that call, logged with the stack, so one request
// cannot take the agent down.
func RecoverUnary(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if r := recover(); r != nil {
				log.ErrorContext(ctx, "grpc handler panicked", "method", info.FullMethod, "panic", r, "stack", string(debug.Stack()))
				resp, err = nil, status.Errorf(codes.Internal, "%s panicked: %v", info.FullMethod, r)
			}
		}()
		return handler(ctx, req)
	}
}

// ServeOption configures ServeListener.
type ServeOption func(*serveOptions)

type serveOptions struct {
	observe func(method string, code codes.Code)
}

// WithObserver has observe told, for each PodAdd ("add") and PodDel ("del")
// the server answers, the gRPC code of its answer (codes.OK on success):
// InvalidArgument for a request refused as malformed, Internal for a
// handler that panicked, the code of the handler's error otherwise. It must
// not block.
func WithObserver(observe func(method string, code codes.Code)) ServeOption {
	return func(o *serveOptions) { o.observe = observe }
}

func (o *serveOptions) observer() grpc.UnaryServerInterceptor {
	methods := map[string]string{
		cniv1.CNIEvents_PodAdd_FullMethodName: "add",
		cniv1.CNIEvents_PodDel_FullMethodName: "del",
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		resp, err := handler(ctx, req)
		if m, ok := methods[info.FullMethod]; ok && o.observe != nil {
			o.observe(m, status.Code(err))
		}
		return resp, err
	}
}

type server struct {
	cniv1.UnimplementedCNIEventsServer
	h   Handler
	log *slog.Logger
}

func (s *server) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	if err := validAdd(req); err != nil {
		s.log.WarnContext(ctx, "cni add refused", "error", err)
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	res, err := s.h.PodAdd(ctx, req)
	if err != nil {
		p := req.GetPod()
		s.log.WarnContext(ctx, "cni add failed", "pod", p.GetNamespace()+"/"+p.GetName(), "error", err)
		return nil, toStatus(err)
	}
	return &cniv1.PodAddResponse{Enrolled: res.Enrolled, Reason: res.Reason}, nil
}

func (s *server) PodDel(ctx context.Context, req *cniv1.PodDelRequest) (*cniv1.PodDelResponse, error) {
	if err := validPod(req.GetPod(), false); err != nil {
		s.log.WarnContext(ctx, "cni del refused", "error", err)
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := s.h.PodDel(ctx, req); err != nil {
		return nil, toStatus(err)
	}
	return &cniv1.PodDelResponse{}, nil
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
// fail pkg/validate's checks; the server answers InvalidArgument. An ADD needs the pod's
// namespace, name and netns; a DEL only something to find the pod by (uid,
// container id, netns, or namespace and name). Every field given is checked.
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

// toStatus maps a handler error to a status code the plugin tells apart:
// no ztunnel, the caller's deadline passed (a timeout, like one of the
// transport's), or the agent could not enroll.
func toStatus(err error) error {
	switch {
	case errors.Is(err, ErrNoZtunnel):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		// The caller's deadline (it travels with the call) passed while
		// the agent worked: for the plugin that is a timeout, whose
		// fallback then decides, not a refusal. As Aborted it could reach
		// the plugin before its own deadline fired and fail a pod that
		// is not ambient.
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}
