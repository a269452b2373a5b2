// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"bytes"
	"context"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

func mustMarshal(tb testing.TB, m proto.Message) []byte {
	tb.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// warmFDs makes the runtime open what it opens once (the netpoller), so
// descriptor counts before and after a test compare like with like.
func warmFDs(tb testing.TB) {
	tb.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		tb.Fatal(err)
	}
	_ = r.Close()
	_ = w.Close()
}

// TestBadInputEndsOnlyThatConnection: each kind of bad input from a peer
// ends that peer's connection with a logged reason naming it; another
// connected ztunnel keeps working, a new one gets the full snapshot, and no
// descriptor (the ones the bad peer sent included) is left open.
func TestBadInputEndsOnlyThatConnection(t *testing.T) {
	devNull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devNull.Close()
	nullFD := int(devNull.Fd())

	ack := mustMarshal(t, &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{}}})
	nack := mustMarshal(t, &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: "some text"}}})
	hello := mustMarshal(t, &zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	oversized := append(protowire.AppendTag(nil, 1, protowire.BytesType), protowire.AppendBytes(nil, bytes.Repeat([]byte{'x'}, 1100))...)
	unknownResponse := protowire.AppendVarint(protowire.AppendTag(nil, 9, protowire.VarintType), 1)

	const (
		atHello    = "hello"
		atSnapshot = "snapshot" // instead of the ack for the first snapshot entry
		atIdle     = "idle"     // after SnapshotSent, nothing in flight
	)
	cases := []struct {
		name   string
		phase  string
		data   []byte
		fds    []int
		hangUp bool   // close instead of sending
		reason string // must appear in the logged reason
	}{
		{name: "oversized datagram instead of hello", phase: atHello, data: oversized, reason: "oversized datagram"},
		{name: "oversized datagram instead of ack", phase: atSnapshot, data: oversized, reason: "oversized datagram"},
		{name: "truncated ack", phase: atSnapshot, data: nack[:len(nack)-3], reason: "undecodable message"},
		{name: "truncated hello", phase: atHello, data: []byte{0x08}, reason: "undecodable message"},
		{name: "unknown response message", phase: atSnapshot, data: unknownResponse, reason: "response without ack: unknown message"},
		{name: "hello with version NOT_USED", phase: atHello, data: []byte{0x08, 0x00}, reason: "unsupported version"},
		{name: "empty datagram instead of hello", phase: atHello, data: []byte{}, reason: "waiting for hello: peer closed"},
		{name: "ack carrying a file descriptor", phase: atSnapshot, data: ack, fds: []int{nullFD}, reason: "ack for keep s1 carried 1 file descriptors"},
		{name: "ack carrying two file descriptors", phase: atSnapshot, data: ack, fds: []int{nullFD, nullFD}, reason: "carried 2 file descriptors"},
		{name: "ack carrying more descriptors than fit", phase: atSnapshot, data: ack, fds: repeatFD(nullFD, 9), reason: "ancillary data truncated"},
		{name: "hello carrying a file descriptor", phase: atHello, data: hello, fds: []int{nullFD}, reason: "hello carried 1 file descriptors"},
		{name: "unsolicited ack while idle", phase: atIdle, data: ack, reason: "unsolicited datagram while idle"},
		{name: "unsolicited descriptor while idle", phase: atIdle, data: ack, fds: []int{nullFD}, reason: "unsolicited datagram while idle (2 bytes, 1 file descriptors)"},
		{name: "disconnect mid-snapshot", phase: atSnapshot, hangUp: true, reason: "during snapshot: waiting for ack for keep s1: peer closed the connection"},
	}

	warmFDs(t)
	before := nstest.OpenFDs(t)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := startServer(t, Config{Snapshot: func() []Workload { return []Workload{{UID: "s1"}} }})
			good := dialRaw(t, h.path)
			good.handshake(1)
			testenv.Eventually(t, time.Second, "good peer registered", func() bool { return h.srv.Connections() == 1 })

			bad := dialRaw(t, h.path)
			if tc.phase != atHello {
				bad.hello()
				if req, _ := bad.recv(); req.GetKeep().GetUid() != "s1" {
					t.Fatalf("bad peer got %v", req)
				}
			}
			if tc.phase == atIdle {
				bad.ack("")
				if req, _ := bad.recv(); req.GetSnapshotSent() == nil {
					t.Fatalf("bad peer got %v", req)
				}
				bad.ack("")
			}
			if tc.hangUp {
				_ = bad.uc.Close()
			} else {
				bad.sendBytes(tc.data, tc.fds...)
				bad.expectClosed(3 * time.Second)
			}
			line := h.logs.waitLine(t, "connection ended", tc.reason)
			t.Logf("logged: %s", line)
			testenv.Eventually(t, 2*time.Second, "only the good peer left", func() bool { return h.srv.Connections() == 1 })

			// The good peer is unaffected.
			h.delThrough(t, "s1", good)
			// A new peer still gets the full snapshot.
			if got := uids(dialRaw(t, h.path).handshake(1)); len(got) != 1 || got[0] != "keep:s1" {
				t.Fatalf("new peer snapshot %v", got)
			}
		})
	}
	nstest.SameFDs(t, before)
}

// TestNoDescriptorLeakAcrossAddNackAndTimeout counts /proc/self/fd around
// a server that sends netns descriptors through acked, NACKed and timed
// out adds and is then stopped.
func TestNoDescriptorLeakAcrossAddNackAndTimeout(t *testing.T) {
	ns := nstest.NewNetns(t)
	warmFDs(t)
	before := nstest.OpenFDs(t)
	func() {
		// The ack timeout bounds every exchange, so it leaves room for a
		// loaded machine; only the last add is meant to run into it.
		h := startServer(t, Config{AckTimeout: time.Second, Snapshot: func() []Workload {
			return []Workload{{UID: "s1", Netns: ns}}
		}})
		p := dialRaw(t, h.path)
		p.handshake(1)
		ctx := context.Background()
		for _, reply := range []string{"", "nack text"} {
			done := doAsync(func() error { return h.srv.AddWorkload(ctx, Workload{UID: "p", Netns: ns}) })
			p.recv()
			p.ack(reply)
			waitErr(t, done)
		}
		if err := h.srv.AddWorkload(ctx, Workload{UID: "p", Netns: "/proc/self/ns/mnt"}); err == nil {
			t.Fatal("a mount namespace was accepted as a netns")
		}
		done := doAsync(func() error { return h.srv.AddWorkload(ctx, Workload{UID: "p", Netns: ns}) })
		p.recv()
		if err := waitErr(t, done); err == nil {
			t.Fatal("unacked add succeeded")
		}
		h.logs.waitLine(t, "connection ended", "no ack for add p within deadline")
		_ = p.uc.Close()
		p.releaseFDs()
		h.stop()
	}()
	nstest.SameFDs(t, before)
}

// repeatFD returns fd n times; nine is one more than the server's control
// buffer holds.
func repeatFD(fd, n int) []int {
	fds := make([]int, n)
	for i := range fds {
		fds[i] = fd
	}
	return fds
}

// TestPanicWhileServingEndsOnlyThatConnection: a panic in a connection's
// session (here from the snapshot callback) is recovered and logged with
// its stack; the server and the other connections keep working.
func TestPanicWhileServingEndsOnlyThatConnection(t *testing.T) {
	var calls atomic.Int32
	h := startServer(t, Config{Snapshot: func() []Workload {
		if calls.Add(1) == 2 {
			panic("snapshot exploded")
		}
		return []Workload{{UID: "s1"}}
	}})
	good := dialRaw(t, h.path)
	good.handshake(1)
	bad := dialRaw(t, h.path)
	bad.hello()
	bad.expectClosed(3 * time.Second)
	line := h.logs.waitLine(t, "ERROR connection ended", "panic serving ztunnel: snapshot exploded")
	if !strings.Contains(line, "goroutine") {
		t.Errorf("logged without a stack: %s", line)
	}
	testenv.Eventually(t, 2*time.Second, "only the good peer left", func() bool { return h.srv.Connections() == 1 })
	h.delThrough(t, "s1", good)
	if got := uids(dialRaw(t, h.path).handshake(1)); len(got) != 1 || got[0] != "keep:s1" {
		t.Fatalf("new peer snapshot %v", got)
	}
}
