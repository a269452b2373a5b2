// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// errAgentDown says no agent answers on the inspection socket.
var errAgentDown = errors.New("the agent does not answer")

// agentStream is the agent's Trace stream as an eventSource.
type agentStream struct {
	conn   *grpc.ClientConn
	stream inspectv1.Inspect_TraceClient
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	closed  bool
	dropped uint64
}

// agentEvents opens the agent's trace stream. It waits for the first
// event (or a second, for a stream that is merely quiet) to tell an agent
// that is down (errAgentDown) from one that refuses (its error).
func agentEvents(ctx context.Context, socket, pod string, since time.Time) (*agentStream, error) {
	if _, err := os.Stat(socket); err != nil {
		return nil, fmt.Errorf("%w: %w", errAgentDown, err)
	}
	conn, err := inspectClient(socket)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errAgentDown, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	s := &agentStream{conn: conn, ctx: ctx, cancel: cancel}
	s.stream, err = inspectv1.NewInspectClient(conn).Trace(ctx, traceRequest(pod, since))
	if err == nil {
		// The agent sends headers once it traces; a refusal (an unknown
		// pod, a busy tracer) ends the call without them, its status
		// left for Recv.
		hctx, hcancel := context.WithTimeout(ctx, 3*time.Second)
		defer hcancel()
		done := make(chan error, 1)
		go func() {
			md, err := s.stream.Header()
			if err == nil && md == nil {
				_, err = s.stream.Recv()
			}
			done <- err
		}()
		select {
		case err = <-done:
		case <-hctx.Done():
			err = hctx.Err()
		}
	}
	if err != nil {
		cancel()
		conn.Close()
		if status.Code(err) == codes.Unavailable || errors.Is(err, context.DeadlineExceeded) {
			return nil, fmt.Errorf("%w: %w", errAgentDown, err)
		}
		if st, ok := status.FromError(err); ok {
			return nil, fmt.Errorf("trace through the agent: %s", st.Message())
		}
		return nil, fmt.Errorf("trace through the agent: %w", err)
	}
	return s, nil
}

func traceRequest(pod string, since time.Time) *inspectv1.TraceRequest {
	r := &inspectv1.TraceRequest{Pod: pod}
	if !since.IsZero() {
		r.SinceUnixNano = since.UnixNano()
	}
	return r
}

func (s *agentStream) Read() (inspect.Event, error) {
	pe, err := s.stream.Recv()
	if err != nil {
		s.mu.Lock()
		closed := s.closed
		s.mu.Unlock()
		// The client's own end (--duration, interrupt) may reach the agent
		// first, which then ends or resets the stream: over, not failed.
		if closed || s.ctx.Err() != nil || status.Code(err) == codes.Canceled || errors.Is(err, io.EOF) {
			return inspect.Event{}, fmt.Errorf("trace through the agent: %w", os.ErrClosed)
		}
		if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown {
			return inspect.Event{}, fmt.Errorf("trace through the agent: %s", st.Message())
		}
		return inspect.Event{}, fmt.Errorf("trace through the agent: %w", err)
	}
	s.mu.Lock()
	s.dropped += pe.Dropped
	s.mu.Unlock()
	return eventFromProto(pe)
}

// Lost is what the agent dropped for this client.
func (s *agentStream) Lost() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropped
}

func (s *agentStream) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		s.cancel()
		return s.conn.Close()
	}
	return nil
}

func eventFromProto(pe *inspectv1.TraceEvent) (inspect.Event, error) {
	e := inspect.Event{Time: time.Unix(0, pe.TimeUnixNano), Pod: pe.Pod, NetnsCookie: pe.NetnsCookie, Proto: pe.Proto, Row: pe.Row}
	var errs []error
	errs = append(errs, e.Hook.UnmarshalText([]byte(pe.Hook)), e.Decision.UnmarshalText([]byte(pe.Decision)), e.Reason.UnmarshalText([]byte(pe.Reason)))
	for _, f := range []struct {
		s   string
		out *netip.AddrPort
	}{{pe.Src, &e.Src}, {pe.Dst, &e.Dst}, {pe.RedirectedTo, &e.To}} {
		if f.s == "" {
			continue
		}
		ap, err := netip.ParseAddrPort(f.s)
		errs = append(errs, err)
		*f.out = ap
	}
	if err := errors.Join(errs...); err != nil {
		return e, fmt.Errorf("decode the agent's trace event: %w", err)
	}
	return e, nil
}
