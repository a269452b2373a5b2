// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// Tracing (bpf/include/trace.h): the programs count every decision in
// ae_decisions, and while ae_tracing is set they also write an event for
// it into the ring buffer ae_trace. One tracer at a time reads the ring (a
// ring buffer has a single consumer position): it holds an flock on the
// pin directory for as long as it traces, and sets the flag only while
// it holds it.

// ErrTraceBusy is returned by OpenTracer while another tracer reads the
// events (the agent streams them to any number of clients: ask it).
var ErrTraceBusy = errors.New("another tracer is reading this data path's events")

// TraceFlagAtLoad is the flag an agent (re)starting on the pins under
// bpffsDir loads: what a tracer holding the lock set, or off when no
// tracer holds it (one that died leaves the flag on, and every decision
// would pay for an event nobody reads).
func TraceFlagAtLoad(bpffsDir string) uint32 {
	lock, err := lockTrace(bpffsDir)
	if err == nil {
		lock.Close()
		return 0
	}
	flag, err := ebpf.LoadPinnedMap(filepath.Join(bpfobj.MapsDir(bpffsDir), bpfobj.TraceFlagMap), nil)
	if err != nil {
		return 0
	}
	defer flag.Close()
	var on uint32
	_ = flag.Lookup(uint32(0), &on)
	return on
}

// lockTrace takes the tracer's lock on the pin directory, without
// waiting.
func lockTrace(bpffsDir string) (*os.File, error) {
	f, err := os.Open(bpffsDir)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, ErrTraceBusy
		}
		return nil, fmt.Errorf("lock %s: %w", bpffsDir, err)
	}
	return f, nil
}

// TraceState says whether the events are on (the programs' flag) and
// whether a tracer holds the lock; on without a holder is a tracer that
// died, and every decision pays for an event nobody reads until the next
// tracer or agent start switches it off.
func TraceState(bpffsDir string) (on, held bool, err error) {
	flag, err := ebpf.LoadPinnedMap(filepath.Join(bpffsDir, "maps", bpfobj.TraceFlagMap), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return false, false, fmt.Errorf("open %s: %w", bpfobj.TraceFlagMap, err)
	}
	defer flag.Close()
	var v uint32
	if err := flag.Lookup(uint32(0), &v); err != nil {
		return false, false, fmt.Errorf("read %s: %w", bpfobj.TraceFlagMap, err)
	}
	lock, err := lockTrace(bpffsDir)
	if errors.Is(err, ErrTraceBusy) {
		return v != 0, true, nil
	}
	if err != nil {
		return v != 0, false, err
	}
	lock.Close()
	return v != 0, false, nil
}

// Event is one decision of the data path, decoded.
type Event struct {
	Time time.Time `json:"time"`
	// Pod is the enrolled pod whose hook decided (namespace/name); empty
	// for sockets of netns that are no enrolled pod's.
	Pod         string         `json:"pod,omitempty"`
	NetnsCookie uint64         `json:"netnsCookie,omitempty"`
	Hook        Hook           `json:"hook"`
	Proto       string         `json:"proto"`
	Src         netip.AddrPort `json:"src,omitzero"` // zero: not bound yet (connect)
	Dst         netip.AddrPort `json:"dst"`          // the original destination
	Decision    Decision       `json:"decision"`
	Reason      Reason         `json:"reason"`
	Row         string         `json:"row"`
	// To is where a captured connection went, or a translated probe's
	// new source.
	To netip.AddrPort `json:"redirectedTo,omitzero"`
}

// Tracer reads decision events from a node's pins, with or without the
// agent. Opening it switches the events on; Close switches them off.
// Read and Close may be called from different goroutines.
type Tracer struct {
	p       *Pinned
	lock    *os.File
	flag    *ebpf.Map
	ring    *ebpf.Map
	rd      *ringbuf.Reader
	start   uint64 // monotonic ns at open: older events are a dead tracer's
	wallOff int64  // wall clock minus monotonic clock, ns
	lost0   uint64
	once    sync.Once
	err     error // of Close

	mu     sync.Mutex // held while decoding; Close waits for it
	closed bool
	lost   uint64 // Lost, once closed
	names  map[uint32]slotName
}

type slotName struct {
	cookie uint64
	name   string
}

// OpenTracer starts tracing the data path pinned under bpffsDir. It
// fails with ErrNotInstalled where nothing is pinned and ErrTraceBusy
// while another tracer reads.
func OpenTracer(bpffsDir string) (_ *Tracer, err error) {
	p, err := OpenPinned(bpffsDir)
	if err != nil {
		return nil, err
	}
	t := &Tracer{p: p, names: map[uint32]slotName{}}
	defer func() {
		if err != nil {
			t.close()
		}
	}()
	if t.lock, err = lockTrace(bpffsDir); err != nil {
		return nil, err
	}
	dir := filepath.Join(bpffsDir, "maps")
	if t.flag, err = ebpf.LoadPinnedMap(filepath.Join(dir, bpfobj.TraceFlagMap), nil); err != nil {
		return nil, fmt.Errorf("open %s: %w (a data path from before tracing: restart the agent)", filepath.Join(dir, bpfobj.TraceFlagMap), err)
	}
	// A writable handle: the reader advances the ring's consumer position.
	if t.ring, err = ebpf.LoadPinnedMap(filepath.Join(dir, bpfobj.SockMapAeTrace), nil); err != nil {
		return nil, fmt.Errorf("open %s: %w", filepath.Join(dir, bpfobj.SockMapAeTrace), err)
	}
	if t.rd, err = ringbuf.NewReader(t.ring); err != nil {
		return nil, fmt.Errorf("read ring buffer %s: %w", bpfobj.SockMapAeTrace, err)
	}
	var mono, wall unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &mono); err != nil {
		return nil, fmt.Errorf("read the monotonic clock: %w", err)
	}
	_ = unix.ClockGettime(unix.CLOCK_REALTIME, &wall)
	t.start = uint64(mono.Nano())
	t.wallOff = wall.Nano() - mono.Nano()
	if d, err := ReadDecisions(&p.maps); err == nil {
		t.lost0 = d.Lost
	}
	if err := t.flag.Put(uint32(0), uint32(1)); err != nil {
		return nil, fmt.Errorf("switch tracing on: %w", err)
	}
	return t, nil
}

// tracePoll bounds how long an event may wait in the ring for the reader.
const tracePoll = 50 * time.Millisecond

// Read blocks for the next event. After Close it returns an error
// wrapping os.ErrClosed.
func (t *Tracer) Read() (Event, error) {
	for {
		// The programs wake the reader only for a batch (trace_submit in
		// bpf/include/trace.h), so it also looks at the ring every tracePoll.
		t.rd.SetDeadline(time.Now().Add(tracePoll))
		rec, err := t.rd.Read()
		if errors.Is(err, os.ErrDeadlineExceeded) {
			continue
		}
		if err != nil {
			return Event{}, fmt.Errorf("read trace events: %w", err)
		}
		var raw bpfobj.SockAeEvent
		if err := binary.Read(bytes.NewReader(rec.RawSample), binary.NativeEndian, &raw); err != nil {
			return Event{}, fmt.Errorf("decode trace event: %w", err)
		}
		if raw.TsNs < t.start {
			continue // left in the ring by a tracer that died
		}
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return Event{}, fmt.Errorf("read trace events: %w", os.ErrClosed)
		}
		e := t.decode(&raw)
		t.mu.Unlock()
		return e, nil
	}
}

func (t *Tracer) decode(raw *bpfobj.SockAeEvent) Event {
	r := Reason(raw.Reason)
	e := Event{
		Time:        time.Unix(0, int64(raw.TsNs)+t.wallOff),
		NetnsCookie: raw.NetnsCookie,
		Hook:        Hook(raw.Hook),
		Proto:       protoName(raw.Proto),
		Dst:         netip.AddrPortFrom(bpfobj.Addr(raw.Daddr), bpfobj.Ntohs(raw.Dport)),
		Decision:    r.Decision(),
		Reason:      r,
		Row:         r.Row(),
		Pod:         t.podName(raw.Slot, raw.NetnsCookie),
	}
	if src := bpfobj.Addr(raw.Saddr); !src.IsUnspecified() || raw.Sport != 0 {
		e.Src = netip.AddrPortFrom(src, bpfobj.Ntohs(raw.Sport))
	}
	if raw.ToPort != 0 {
		e.To = netip.AddrPortFrom(bpfobj.Addr(raw.To), bpfobj.Ntohs(raw.ToPort))
	}
	return e
}

// podName names the pod in a slot, checked against the event's netns
// cookie where it has one (a slot is reused after its pod left).
func (t *Tracer) podName(slot uint32, cookie uint64) string {
	if slot >= bpfobj.MaxPods {
		return ""
	}
	if n, ok := t.names[slot]; ok && (cookie == 0 || n.cookie == cookie) {
		return n.name
	}
	var meta bpfobj.SockPodMeta
	if err := t.p.maps.AePodMeta.Lookup(slot, &meta); err != nil || meta.State == bpfobj.MetaFree {
		return ""
	}
	n := slotName{cookie: meta.NetnsCookie, name: bpfobj.GoString(meta.Namespace[:]) + "/" + bpfobj.GoString(meta.Name[:])}
	t.names[slot] = n
	if cookie != 0 && n.cookie != cookie {
		return ""
	}
	return n.name
}

func protoName(p uint8) string {
	switch p {
	case unix.IPPROTO_TCP:
		return "tcp"
	case unix.IPPROTO_UDP:
		return "udp"
	}
	return fmt.Sprintf("proto %d", p)
}

// Lost returns how many events the programs dropped since the tracer
// opened, because the ring was full (until Close).
func (t *Tracer) Lost() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return t.lost
	}
	return t.lostLocked()
}

func (t *Tracer) lostLocked() uint64 {
	d, err := ReadDecisions(&t.p.maps)
	if err != nil || d.Lost < t.lost0 {
		return 0
	}
	return d.Lost - t.lost0
}

// Close switches the events off, unblocks Read and releases the tracer;
// it may be called more than once, from any goroutine.
func (t *Tracer) Close() error {
	t.once.Do(func() {
		if err := t.flag.Put(uint32(0), uint32(0)); err != nil {
			t.err = fmt.Errorf("switch tracing off: %w", err)
		}
		t.mu.Lock()
		defer t.mu.Unlock()
		t.lost = t.lostLocked()
		t.closed = true
		t.err = errors.Join(t.err, t.close())
	})
	return t.err
}

func (t *Tracer) close() error {
	var errs []error
	if t.rd != nil {
		errs = append(errs, t.rd.Close())
	}
	for _, m := range []*ebpf.Map{t.ring, t.flag} {
		if m != nil {
			errs = append(errs, m.Close())
		}
	}
	if t.lock != nil {
		errs = append(errs, t.lock.Close()) // releases the flock
	}
	errs = append(errs, t.p.Close())
	return errors.Join(errs...)
}

// Decisions are the programs' decision counters, summed over CPUs.
type Decisions struct {
	// ByReason counts each reason's decisions since the maps were made;
	// forwarded (H2) is traced but never counted.
	ByReason map[Reason]uint64 `json:"byReason"`
	// Lost counts trace events dropped because the ring was full.
	Lost uint64 `json:"lostEvents"`
}

// ReadDecisions reads the programs' decision counters from the maps.
func ReadDecisions(m *bpfobj.SockMaps) (Decisions, error) {
	d := Decisions{ByReason: map[Reason]uint64{}}
	perCPU := make([]uint64, ebpf.MustPossibleCPU())
	for _, r := range append(Reasons(), Reason(bpfobj.TraceLost)) {
		if err := m.AeDecisions.Lookup(uint32(r), &perCPU); err != nil {
			return d, fmt.Errorf("read ae_decisions: %w", err)
		}
		var n uint64
		for _, v := range perCPU {
			n += v
		}
		if r == bpfobj.TraceLost {
			d.Lost = n
		} else {
			d.ByReason[r] = n
		}
	}
	return d, nil
}

// Decisions reads the programs' decision counters.
func (p *Pinned) Decisions() (Decisions, error) { return ReadDecisions(&p.maps) }
