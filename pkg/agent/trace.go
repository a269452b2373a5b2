// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// traceHub shares the data path's one event reader among the inspection
// API's trace clients: the first client opens it (switching the events
// on), the last one to leave closes it (switching them off).
//
// With a history window (--trace-history) the hub traces from the start
// and keeps the events of that window, so a client can ask what happened
// before it came (trace --since); the programs then build events all the
// time, a cost the benchmark's "tracing on" figures show.
type traceHub struct {
	bpffs   string
	history time.Duration
	log     *slog.Logger

	mu     sync.Mutex
	tracer *inspect.Tracer
	subs   map[*traceSub]struct{}
	past   []inspect.Event // oldest first, within history, at most maxHistory
}

// traceSub is one client's share.
type traceSub struct {
	pod     string // namespace/name; empty: every event
	ch      chan inspect.Event
	dropped uint64 // events the client was too slow for, under traceHub.mu
}

// traceBuffer is how many events a client may fall behind before the
// hub drops events for it (and tells it how many).
const traceBuffer = 1024

// maxHistory bounds the history by count as well as by time (about 200
// bytes an event: 64 MiB at most).
const maxHistory = 1 << 18

// errNoHistory refuses a replay from an agent that keeps no history.
var errNoHistory = errors.New("the agent keeps no trace history: start it with --trace-history (chart: agent.traceHistory)")

func newTraceHub(bpffs string, history time.Duration, log *slog.Logger) *traceHub {
	return &traceHub{bpffs: bpffs, history: history, log: log, subs: map[*traceSub]struct{}{}}
}

// run keeps the history until ctx ends; without a history window it
// returns at once (clients switch tracing on and off).
func (h *traceHub) run(ctx context.Context) {
	if h.history <= 0 {
		return
	}
	for {
		h.mu.Lock()
		err := h.openLocked()
		h.mu.Unlock()
		if err == nil {
			h.log.Info("tracing on for the history", "window", h.history)
			break
		}
		// A `trace --pins` holds the ring: try again when it may have gone.
		h.log.Warn("cannot keep a trace history yet; retrying", "error", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
	<-ctx.Done()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closeLocked()
}

func (h *traceHub) openLocked() error {
	if h.tracer != nil {
		return nil
	}
	t, err := inspect.OpenTracer(h.bpffs)
	if err != nil {
		return err
	}
	h.tracer = t
	go h.pump(t)
	return nil
}

func (h *traceHub) closeLocked() {
	if h.tracer == nil {
		return
	}
	if err := h.tracer.Close(); err != nil {
		h.log.Warn("switch tracing off", "error", err)
	}
	h.tracer = nil
	h.past = nil
	h.log.Info("tracing off")
}

// subscribe adds a client. With since set it also returns the history's
// events from then on (for the client's pod): taken under the same lock
// that adds the client, so the replay and the live events neither miss
// nor repeat one.
func (h *traceHub) subscribe(pod string, since time.Time) (*traceSub, []inspect.Event, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !since.IsZero() && h.history <= 0 {
		return nil, nil, errNoHistory
	}
	if h.tracer == nil {
		if err := h.openLocked(); err != nil {
			return nil, nil, err
		}
		h.log.Info("tracing on", "clients", 1)
	}
	var replay []inspect.Event
	if !since.IsZero() {
		for _, e := range h.past {
			if !e.Time.Before(since) && (pod == "" || e.Pod == pod) {
				replay = append(replay, e)
			}
		}
	}
	s := &traceSub{pod: pod, ch: make(chan inspect.Event, traceBuffer)}
	h.subs[s] = struct{}{}
	return s, replay, nil
}

func (h *traceHub) unsubscribe(s *traceSub) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs, s)
	if len(h.subs) == 0 && h.history <= 0 {
		h.closeLocked()
	}
}

// remember adds e to the history and drops what fell out of the window.
// Reslicing drops the front without copying; append copies only the live
// events when it grows the array. Under h.mu.
func (h *traceHub) remember(e inspect.Event) {
	if h.history <= 0 {
		return
	}
	h.past = append(h.past, e)
	oldest := time.Now().Add(-h.history)
	cut := max(len(h.past)-maxHistory, 0)
	for cut < len(h.past) && h.past[cut].Time.Before(oldest) {
		cut++
	}
	h.past = h.past[cut:]
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
func (h *traceHub) pump(t *inspect.Tracer) {
	for {
		e, err := t.Read()
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				h.log.Error("trace reader stopped", "error", err)
			}
			return
		}
		h.mu.Lock()
		h.remember(e)
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
		return status.Errorf(codes.NotFound, "pod %s: %v", req.Pod, inspect.ErrUnknownPod)
	}
	var since time.Time
	if req.SinceUnixNano != 0 {
		since = time.Unix(0, req.SinceUnixNano)
	}
	s, replay, err := i.trace.subscribe(req.Pod, since)
	if errors.Is(err, errNoHistory) {
		return status.Error(codes.FailedPrecondition, err.Error())
	}
	if errors.Is(err, inspect.ErrTraceBusy) {
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
	for _, e := range replay {
		if err := stream.Send(traceEventProto(e)); err != nil {
			return err
		}
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

func traceEventProto(e inspect.Event) *inspectv1.TraceEvent {
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
