// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// Z1: a hello with a version after V1 connects (and is logged), as
// istio-cni lets a newer ztunnel in.
func TestHelloWithALaterVersionConnects(t *testing.T) {
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.sendMsg(&zdsapi.ZdsHello{Version: zdsapi.Version(7)})
	if req, _ := p.recv(); req.GetSnapshotSent() == nil {
		t.Fatalf("got %v, want snapshot_sent", req)
	}
	p.ack("")
	h.logs.waitLine(t, "ztunnel connected", "version=7")
	testenv.Eventually(t, time.Second, "peer registered", func() bool { return h.srv.Connections() == 1 })
}

// Z6: a malformed answer to a live request fails that request; the
// connection stays and serves the next one.
func TestMalformedAckToALiveRequestKeepsTheConnection(t *testing.T) {
	ns := "/proc/self/ns/net"
	h := startServer(t, Config{})
	p := dialRaw(t, h.path)
	p.handshake(0)
	testenv.Eventually(t, time.Second, "peer registered", func() bool { return h.srv.Connections() == 1 })
	done := doAsync(func() error { return h.srv.AddWorkload(context.Background(), Workload{UID: "p", Netns: ns}) })
	if req, _ := p.recv(); req.GetAdd().GetUid() != "p" {
		t.Fatalf("got %v", req)
	}
	p.sendBytes([]byte{0x0a, 0x05, 0x0a}) // a truncated WorkloadResponse
	if err := waitErr(t, done); err == nil {
		t.Fatal("AddWorkload with a malformed ack succeeded")
	}
	h.logs.waitLine(t, "malformed ack to a live request; connection kept")
	if n := h.srv.Connections(); n != 1 {
		t.Fatalf("connections %d after a malformed ack; want 1", n)
	}
	h.delThrough(t, "p", p)
}

// OnAck hears every answer: snapshot entries and live requests, acks and
// NACKs.
func TestEveryAnswerIsReported(t *testing.T) {
	var mu sync.Mutex
	var got []Ack
	h := startServer(t, Config{
		Snapshot: func() []Workload { return []Workload{{UID: "s1"}} },
		OnAck: func(a Ack) {
			mu.Lock()
			defer mu.Unlock()
			a.Err = errors.Unwrap(a.Err) // keep the comparison to the kind of error
			got = append(got, a)
		},
	})
	p := dialRaw(t, h.path)
	p.hello()
	p.recv() // keep s1
	p.ack("busy")
	p.recv() // snapshot_sent
	p.ack("")
	testenv.Eventually(t, time.Second, "peer registered", func() bool { return h.srv.Connections() == 1 })
	for _, reply := range []string{"", "netns gone"} {
		done := doAsync(func() error {
			return h.srv.AddWorkload(context.Background(), Workload{UID: "p", Netns: "/proc/self/ns/net"})
		})
		p.recv()
		p.ack(reply)
		err := waitErr(t, done)
		if (reply == "") != (err == nil) || reply != "" && !errors.Is(err, ErrNack) {
			t.Fatalf("AddWorkload answered %q: %v", reply, err)
		}
	}
	h.delThrough(t, "p", p)
	mu.Lock()
	defer mu.Unlock()
	var ops []string
	for _, a := range got {
		s := string(a.Op) + " " + a.UID
		if a.Snapshot {
			s += " snapshot"
		}
		if a.Err != nil {
			s += " nack"
		}
		ops = append(ops, s)
	}
	want := []string{"keep s1 snapshot nack", "add p", "add p nack", "del p"}
	if !slices.Equal(ops, want) {
		t.Errorf("OnAck heard %v; want %v", ops, want)
	}
}
