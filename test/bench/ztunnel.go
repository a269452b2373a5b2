// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// ztunnel is the stand-in, serving both meshed paths. Instead of a records
// file it keeps counters, so the benchmark can prove every meshed
// connection went through it (and no direct one did). It also plays the
// ztunnel the node agent hands pods to over ZDS (acker).
type ztunnel struct {
	proxy *standin.Proxy
	rec   *recordCounter
	acker acker
	stop  context.CancelFunc // ends the ZDS session
	done  chan error
}

// acker is the ztunnel of the CNI enrolment figures: it takes pods over ZDS
// and acks each at once, opening none of their sockets, so the figures time
// the agent and not a proxy's set-up. The traffic pods get their sockets
// from the stand-in directly (op add).
type acker struct{ adds, keeps, dels atomic.Int64 }

func (a *acker) Add(context.Context, string, *zdsapi.WorkloadInfo, *os.File) error {
	a.adds.Add(1)
	return nil
}

func (a *acker) Keep(context.Context, string) error {
	a.keeps.Add(1)
	return nil
}

func (a *acker) Del(context.Context, string) error {
	a.dels.Add(1)
	return nil
}

func (a *acker) SnapshotSent(context.Context, []string) error { return nil }

// zdsCounts are the requests the acker took.
type zdsCounts struct {
	Adds  int64 `json:"adds"`
	Keeps int64 `json:"keeps"`
	Dels  int64 `json:"dels"`
}

// recordCounter counts the stand-in's records (one Write each) by
// listener.
type recordCounter struct {
	outbound, inbound, errors atomic.Int64
	lastError                 atomic.Value // string: the latest failed record
}

// ztunnelCounts is a snapshot of the counters.
type ztunnelCounts struct {
	Outbound int64 `json:"outbound"` // connections accepted on :15001
	Inbound  int64 `json:"inbound"`  // on :15006
	Errors   int64 `json:"errors"`   // connections it could not relay
	// LastError is the record of the latest connection it could not relay.
	LastError string `json:"lastError,omitempty"`
}

var (
	outboundTag = fmt.Appendf(nil, `"listener":%d,`, standin.OutboundPort)
	inboundTag  = fmt.Appendf(nil, `"listener":%d,`, standin.InboundPort)
)

func (r *recordCounter) Write(p []byte) (int, error) {
	switch {
	case bytes.Contains(p, []byte(`"error":`)):
		r.errors.Add(1)
		r.lastError.Store(string(p))
	case bytes.Contains(p, outboundTag):
		r.outbound.Add(1)
	case bytes.Contains(p, inboundTag):
		r.inbound.Add(1)
	}
	return len(p), nil
}

func newZtunnel() *ztunnel {
	rec := &recordCounter{}
	return &ztunnel{proxy: standin.New(standin.Config{Records: rec}), rec: rec}
}

type ztunnelRequest struct {
	Op     string `json:"op"` // add, counts, zds, zds-counts
	UID    string `json:"uid,omitempty"`
	Netns  string `json:"netns,omitempty"`
	Socket string `json:"socket,omitempty"` // zds: the agent's ZDS socket
}

func (z *ztunnel) handle(line []byte) (any, error) {
	req, err := decode[ztunnelRequest](line)
	if err != nil {
		return nil, err
	}
	switch req.Op {
	case "add":
		f, err := os.Open(req.Netns)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return nil, z.proxy.AddPod(req.UID, f)
	case "counts":
		c := ztunnelCounts{Outbound: z.rec.outbound.Load(), Inbound: z.rec.inbound.Load(), Errors: z.rec.errors.Load()}
		c.LastError, _ = z.rec.lastError.Load().(string)
		return c, nil
	case "zds":
		if z.stop != nil {
			return nil, errors.New("already connected over ZDS")
		}
		// A quick reconnect after the agent restarts, as ztunnel's.
		c, err := zdsclient.New(zdsclient.Config{SocketPath: req.Socket, Handler: &z.acker, MinBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
		if err != nil {
			return nil, err
		}
		var ctx context.Context
		ctx, z.stop = context.WithCancel(context.Background())
		z.done = make(chan error, 1)
		go func() { z.done <- c.Run(ctx) }()
		return nil, nil
	case "zds-counts":
		return zdsCounts{Adds: z.acker.adds.Load(), Keeps: z.acker.keeps.Load(), Dels: z.acker.dels.Load()}, nil
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

func (z *ztunnel) close() {
	if z.stop != nil {
		z.stop()
		<-z.done
	}
	z.proxy.Close()
}
