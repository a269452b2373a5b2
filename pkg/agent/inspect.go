// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/takeover"
)

// DefaultInspectSocket is where the agent answers the CLI.
const DefaultInspectSocket = "/var/run/ambient-ebpf/inspect.sock"

type inspector struct {
	inspectv1.UnimplementedInspectServer
	a     *agent
	rec   *reconciler.Reconciler
	trace *traceHub
}

func (i *inspector) Status(context.Context, *inspectv1.StatusRequest) (*inspectv1.StatusResponse, error) {
	ready, why := i.a.ready()
	resp := &inspectv1.StatusResponse{
		Ready: ready, NotReadyReason: why, ZtunnelConnections: int32(i.a.zt.Connections()),
		Node: i.a.cfg.NodeName, Source: "kubernetes", BpffsDir: i.a.cfg.Dataplane.BPFFSDir,
		Features: i.a.features,
	}
	if i.a.cfg.StandalonePods != "" {
		resp.Source = "pod file " + i.a.cfg.StandalonePods
	}
	for _, p := range i.rec.Pods() {
		resp.EnrolledPods++
		if p.Redirection == enrollment.RedirectionPending {
			resp.PendingPods++
		}
	}
	resp.IstioCniTakeover, resp.IstioCniHandback = i.a.takeover != nil, string(i.a.cfg.IstioCNIHandBack)
	if i.a.takeover != nil {
		states := i.a.takeover.States()
		slices.SortFunc(states, func(a, b takeover.State) int {
			return cmp.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
		})
		for _, s := range states {
			resp.IstioCni = append(resp.IstioCni, &inspectv1.IstioCNIPod{Namespace: s.Namespace, Name: s.Name, Uid: s.UID,
				Phase: s.Phase, Flows: int32(s.Flows), Reason: s.Reason})
		}
	}
	return resp, nil
}

// serveInspect serves the inspection API on a root-only unix socket until
// ctx ends. Like the other sockets it replaces only a stale socket of ours
// (internal/unixsock); a panic in a call fails that call, logged.
func serveInspect(ctx context.Context, path string, srv inspectv1.InspectServer, log *slog.Logger) (<-chan error, error) {
	ln, err := unixsock.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("inspection socket: %w", err)
	}
	g := grpc.NewServer(grpc.ChainUnaryInterceptor(recoverUnary(log)))
	inspectv1.RegisterInspectServer(g, srv)
	done := make(chan error, 1)
	go func() {
		err := g.Serve(ln)
		_ = ln.Close() // done means the socket file is gone
		done <- err
	}()
	go func() {
		<-ctx.Done()
		g.Stop()
	}()
	return done, nil
}

// recoverUnary is a gRPC interceptor that turns a panic in a handler into
// an Internal error for that call, logged with the stack, so one request
// cannot take the agent down.
func recoverUnary(log *slog.Logger) grpc.UnaryServerInterceptor {
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
