// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"fmt"
	"os"
	"sync/atomic"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// ztunnel is the stand-in, serving both meshed paths. Instead of a records
// file it keeps counters, so the benchmark can prove every meshed
// connection went through it (and no direct one did).
type ztunnel struct {
	proxy *standin.Proxy
	rec   *recordCounter
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
	Op    string `json:"op"` // add, counts
	UID   string `json:"uid,omitempty"`
	Netns string `json:"netns,omitempty"`
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
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

func (z *ztunnel) close() { z.proxy.Close() }
