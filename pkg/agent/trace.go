// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
)

// traceHub shares the data path's one event reader among the inspection
// API's trace clients: the first client opens it (switching the events
// on), the last one to leave closes it (switching them off).
type traceHub struct {
	bpffs string
	log   *slog.Logger

	mu     sync.Mutex
	tracer *dataplane.Tracer
	subs   map[*traceSub]struct{}
}

// traceSub is one client's share.
type traceSub struct {
	pod     string // namespace/name; empty: every event
	ch      chan dataplane.Event
	dropped uint64 // events the client was too slow for, under traceHub.mu
}

// traceBuffer is how many events a client may fall behind before the
// hub drops events for it (and tells it how many).
const traceBuffer = 1024

func newTraceHub(bpffs string, log *slog.Logger) *traceHub {
	return &traceHub{bpffs: bpffs, log: log, subs: map[*traceSub]struct{}{}}
}

func (h *traceHub) subscribe(pod string) (*traceSub, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.tracer == nil {
		t, err := dataplane.OpenTracer(h.bpffs)
		if err != nil {
			return nil, err
		}
		h.tracer = t
		go h.pump(t)
		h.log.Info("tracing on", "clients", 1)
	}
	s := &traceSub{pod: pod, ch: make(chan dataplane.Event, traceBuffer)}
	h.subs[s] = struct{}{}
	return s, nil
}

func (h *traceHub) unsubscribe(s *traceSub) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs, s)
	if len(h.subs) == 0 && h.tracer != nil {
		if err := h.tracer.Close(); err != nil {
			h.log.Warn("switch tracing off", "error", err)
		}
		h.tracer = nil
		h.log.Info("tracing off")
	}
}

// takeDropped returns and resets what s missed.
func (h *traceHub) takeDropped(s *traceSub) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := s.dropped
	s.dropped = 0
	return n
}

// pump hands t's events to the clients until t is closed.
func (h *traceHub) pump(t *dataplane.Tracer) {
	for {
		e, err := t.Read()
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				h.log.Error("trace reader stopped", "error", err)
			}
			return
		}
		h.mu.Lock()
		for s := range h.subs {
			if s.pod != "" && s.pod != e.Pod {
				continue
			}
			select {
			case s.ch <- e:
			default:
				s.dropped++
			}
		}
		h.mu.Unlock()
	}
}

// Trace streams decisions to one client.
func (i *inspector) Trace(req *inspectv1.TraceRequest, stream inspectv1.Inspect_TraceServer) error {
	if req.Pod != "" && !i.enrolled(req.Pod) {
		return status.Errorf(codes.NotFound, "pod %s: %v", req.Pod, dataplane.ErrUnknownPod)
	}
	s, err := i.trace.subscribe(req.Pod)
	if errors.Is(err, dataplane.ErrTraceBusy) {
		return status.Errorf(codes.FailedPrecondition, "%v: an `ambient-ebpf trace --pins` reads the events directly", err)
	}
	if err != nil {
		return status.Errorf(codes.Internal, "open trace: %v", err)
	}
	defer i.trace.unsubscribe(s)
	// Headers tell the client it is tracing before any event comes.
	if err := stream.SendHeader(metadata.Pairs("tracing", "on")); err != nil {
		return err
	}
	for {
		select {
		case <-stream.Context().Done():
			return nil
		case e := <-s.ch:
			pe := traceEventProto(e)
			pe.Dropped = i.trace.takeDropped(s)
			if err := stream.Send(pe); err != nil {
				return err
			}
		}
	}
}

func (i *inspector) enrolled(pod string) bool {
	for _, p := range i.rec.Pods() {
		if p.Namespace+"/"+p.Name == pod {
			return true
		}
	}
	return false
}

func traceEventProto(e dataplane.Event) *inspectv1.TraceEvent {
	return &inspectv1.TraceEvent{
		TimeUnixNano: e.Time.UnixNano(), Pod: e.Pod, NetnsCookie: e.NetnsCookie, Hook: e.Hook.String(), Proto: e.Proto,
		Src: addrPortString(e.Src), Dst: addrPortString(e.Dst), Decision: e.Decision.String(), Reason: e.Reason.String(),
		Row: e.Row, RedirectedTo: addrPortString(e.To),
	}
}

func addrPortString(ap netip.AddrPort) string {
	if !ap.IsValid() {
		return ""
	}
	return ap.String()
}
