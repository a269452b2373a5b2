// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package zdsclient is the ztunnel side of ZDS for the ztunnel stand-in
// (contract section 4). It connects to the agent's SOCK_SEQPACKET socket,
// says ZdsHello{V1}, and turns each request into a Handler call, acking it
// (a handler error becomes a NACK carrying the error text). It enforces the
// protocol the way ztunnel does: AddWorkload must carry exactly one
// descriptor and workload_info, nothing else may carry descriptors, and a
// second SnapshotSent or a KeepWorkload after it ends the session. When the
// agent goes away the client reconnects with exponential backoff.
//
// API:
//
//	func New(cfg Config) (*Client, error)
//	func (c *Client) Run(ctx context.Context) error
//	func ServeConn(ctx context.Context, uc *net.UnixConn, h Handler, log *slog.Logger) error
//	func HandlerFor(p PodSet) Handler // adapts a proxy with AddPod/DelPod/Pods
//
// Config.Observe sees every request as it arrived (Observed: session,
// kind, uid, workload info, descriptors and the netns they name), for
// transcripts of what an agent sent.
package zdsclient

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/zdswire"
)

// DefaultSocketPath is where the agent listens.
const DefaultSocketPath = "/var/run/ztunnel/ztunnel.sock"

// ErrProtocol marks a session ended because the agent broke the protocol.
var ErrProtocol = errors.New("zds protocol error")

// Handler receives what the agent hands over, one call at a time.
type Handler interface {
	// Add starts serving the pod. netns is the pod's network namespace; the
	// client closes it when Add returns, so keep a dup if it is needed later.
	Add(ctx context.Context, uid string, info *zdsapi.WorkloadInfo, netns *os.File) error
	// Keep keeps the pod's proxy if it has one (snapshot only).
	Keep(ctx context.Context, uid string) error
	// Del stops serving the pod.
	Del(ctx context.Context, uid string) error
	// SnapshotSent ends the snapshot: drop every pod whose uid is not in
	// snapshot (the uids added or kept since this connection began).
	SnapshotSent(ctx context.Context, snapshot []string) error
}

// Config configures a Client.
type Config struct {
	SocketPath string  // DefaultSocketPath if empty
	Handler    Handler // required
	Logger     *slog.Logger
	// MinBackoff and MaxBackoff bound the reconnect delay (100 ms, 5 s).
	MinBackoff, MaxBackoff time.Duration
	// OnSessionEnd, if set, is called with the reason each session ended.
	OnSessionEnd func(error)
	// Observe, if set, is called with each request as it arrived, before
	// any check: the transcript of what the agent sent.
	Observe func(Observed)
}

// Observed is one request as ztunnel received it.
type Observed struct {
	Time    time.Time `json:"time"`
	Session int       `json:"session"` // 1 for the first connection, counting up
	// Kind is add, keep, del or snapshot_sent; malformed when it did not
	// decode.
	Kind string `json:"kind"`
	UID  string `json:"uid,omitempty"`
	// Name, Namespace and ServiceAccount are the AddWorkload's
	// workload_info; Info says whether it was set.
	Info           bool   `json:"info,omitempty"`
	Name           string `json:"name,omitempty"`
	Namespace      string `json:"namespace,omitempty"`
	ServiceAccount string `json:"serviceAccount,omitempty"`
	FDs            int    `json:"fds"`
	// NetnsDev and NetnsIno identify what the first descriptor names (Z9).
	NetnsDev uint64 `json:"netnsDev,omitempty"`
	NetnsIno uint64 `json:"netnsIno,omitempty"`
}

// Client keeps one session with the agent alive.
type Client struct {
	cfg Config
	log *slog.Logger

	mu  sync.Mutex
	cur *net.UnixConn // the session's connection, while one runs
}

// Drop closes the running session's connection, as a ztunnel whose
// connection to the agent broke; Run reconnects. It reports whether a
// session was running.
func (c *Client) Drop() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		return false
	}
	_ = c.cur.Close()
	return true
}

// New validates cfg; it does no I/O.
func New(cfg Config) (*Client, error) {
	if cfg.Handler == nil {
		return nil, errors.New("zdsclient: nil handler")
	}
	if cfg.SocketPath == "" {
		cfg.SocketPath = DefaultSocketPath
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 100 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(5*time.Second, cfg.MinBackoff)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Client{cfg: cfg, log: log.With("component", "zdsclient", "socket", cfg.SocketPath)}, nil
}

// Run connects and serves sessions until ctx is done, reconnecting with
// jittered exponential backoff; a session that got past SnapshotSent
// resets the backoff. It returns nil when ctx ends.
func (c *Client) Run(ctx context.Context) error {
	backoff := c.cfg.MinBackoff
	session := 0
	for {
		uc, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: c.cfg.SocketPath, Net: "unixpacket"})
		if err == nil {
			var synced bool
			session++
			c.mu.Lock()
			c.cur = uc
			c.mu.Unlock()
			synced, err = serve(ctx, uc, c.cfg.Handler, c.log, c.observer(session))
			c.mu.Lock()
			c.cur = nil
			c.mu.Unlock()
			_ = uc.Close()
			if synced {
				backoff = c.cfg.MinBackoff
			}
		} else {
			err = fmt.Errorf("dial agent: %w", err)
		}
		if ctx.Err() != nil {
			return nil
		}
		c.log.Warn("session ended; reconnecting", "reason", err.Error(), "backoff", backoff)
		if c.cfg.OnSessionEnd != nil {
			c.cfg.OnSessionEnd(err)
		}
		t := time.NewTimer(backoff/2 + rand.N(backoff/2+1))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		backoff = min(2*backoff, c.cfg.MaxBackoff)
	}
}

// ServeConn speaks ZDS on an established connection until it ends and
// returns why (ctx.Err() when ctx ended it). It does not close uc.
func ServeConn(ctx context.Context, uc *net.UnixConn, h Handler, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	_, err := serve(ctx, uc, h, log, nil)
	return err
}

// observer is Config.Observe for one session, or nil.
func (c *Client) observer(session int) func(Observed) {
	if c.cfg.Observe == nil {
		return nil
	}
	return func(o Observed) {
		o.Session = session
		c.cfg.Observe(o)
	}
}

// observe describes a request for an observer.
func observe(req *zdsapi.WorkloadRequest, fds []int) Observed {
	o := Observed{Time: time.Now(), Kind: "malformed", FDs: len(fds)}
	if len(fds) > 0 {
		var st unix.Stat_t
		if unix.Fstat(fds[0], &st) == nil {
			o.NetnsDev, o.NetnsIno = st.Dev, st.Ino
		}
	}
	switch p := req.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add:
		o.Kind, o.UID = "add", p.Add.GetUid()
		if info := p.Add.GetWorkloadInfo(); info != nil {
			o.Info, o.Name, o.Namespace, o.ServiceAccount = true, info.GetName(), info.GetNamespace(), info.GetServiceAccount()
		}
	case *zdsapi.WorkloadRequest_Keep:
		o.Kind, o.UID = "keep", p.Keep.GetUid()
	case *zdsapi.WorkloadRequest_Del:
		o.Kind, o.UID = "del", p.Del.GetUid()
	case *zdsapi.WorkloadRequest_SnapshotSent:
		o.Kind = "snapshot_sent"
	}
	return o
}

// maxAckText leaves room for the Ack framing inside one datagram.
const maxAckText = zdswire.MaxDatagram - 16

func serve(ctx context.Context, uc *net.UnixConn, h Handler, log *slog.Logger, obs func(Observed)) (synced bool, err error) {
	// A read deadline in the past unblocks Recv when ctx ends.
	stop := context.AfterFunc(ctx, func() { _ = uc.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	defer func() {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
	}()

	if err := zdswire.Send(uc, &zdsapi.ZdsHello{Version: zdsapi.Version_V1}); err != nil {
		return false, fmt.Errorf("send hello: %w", err)
	}
	var snapshot []string
	for {
		data, fds, err := zdswire.Recv(uc)
		if err != nil {
			return synced, err
		}
		req, err := zdswire.DecodeRequest(data)
		if obs != nil {
			obs(observe(req, fds))
		}
		if err != nil {
			zdswire.CloseAll(fds)
			return synced, fmt.Errorf("%w: %w", ErrProtocol, err)
		}
		var herr error
		switch p := req.GetPayload().(type) {
		case *zdsapi.WorkloadRequest_Add:
			uid, info := p.Add.GetUid(), p.Add.GetWorkloadInfo()
			if len(fds) != 1 || info == nil {
				zdswire.CloseAll(fds)
				return synced, fmt.Errorf("%w: add %s with %d descriptors, workload_info set: %t", ErrProtocol, uid, len(fds), info != nil)
			}
			netns := os.NewFile(uintptr(fds[0]), "netns of "+uid)
			herr = h.Add(ctx, uid, info, netns)
			_ = netns.Close()
			if !synced {
				snapshot = append(snapshot, uid)
			}
		case *zdsapi.WorkloadRequest_Keep:
			if err := noFDs("keep", fds); err != nil {
				return synced, err
			}
			if synced {
				return synced, fmt.Errorf("%w: keep %s after snapshot_sent", ErrProtocol, p.Keep.GetUid())
			}
			herr = h.Keep(ctx, p.Keep.GetUid())
			snapshot = append(snapshot, p.Keep.GetUid())
		case *zdsapi.WorkloadRequest_Del:
			if err := noFDs("del", fds); err != nil {
				return synced, err
			}
			herr = h.Del(ctx, p.Del.GetUid())
		case *zdsapi.WorkloadRequest_SnapshotSent:
			if err := noFDs("snapshot_sent", fds); err != nil {
				return synced, err
			}
			if synced {
				return synced, fmt.Errorf("%w: second snapshot_sent", ErrProtocol)
			}
			synced = true
			herr = h.SnapshotSent(ctx, snapshot)
			snapshot = nil
		}
		if herr != nil {
			log.Warn("nack", "request", req.String(), "error", herr.Error())
		}
		if err := sendAck(uc, herr); err != nil {
			return synced, err
		}
	}
}

func noFDs(what string, fds []int) error {
	if len(fds) == 0 {
		return nil
	}
	zdswire.CloseAll(fds)
	return fmt.Errorf("%w: %s carried %d descriptors", ErrProtocol, what, len(fds))
}

func sendAck(uc *net.UnixConn, herr error) error {
	var text string
	if herr != nil {
		text = herr.Error()
		if text == "" {
			text = "error"
		}
		if len(text) > maxAckText {
			text = strings.ToValidUTF8(text[:maxAckText], "")
		}
	}
	ack := &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: text}}}
	if err := zdswire.Send(uc, ack); err != nil {
		return fmt.Errorf("send ack: %w", err)
	}
	return nil
}
