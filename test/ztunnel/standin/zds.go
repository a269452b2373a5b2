// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standin

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"sync/atomic"
	"time"

	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// ServeZDS receives pods from the node agent over ZDS at socketPath, as
// ztunnel does, reconnecting whenever the agent goes away, until ctx ends;
// each request goes to Config.Transcript as it arrives.
func (p *Proxy) ServeZDS(ctx context.Context, socketPath string) error {
	var h zdsclient.Handler = zdsclient.HandlerFor(p)
	if p.cfg.AckDelay > 0 || p.cfg.NackAdds > 0 {
		u := &unreliable{Handler: h, delay: p.cfg.AckDelay}
		u.nacks.Store(int64(p.cfg.NackAdds))
		h = u
	}
	cfg := zdsclient.Config{SocketPath: socketPath, Handler: h, Logger: p.log}
	if w := p.cfg.Transcript; w != nil {
		enc := json.NewEncoder(w) // one session at a time: no lock
		cfg.Observe = func(o zdsclient.Observed) {
			if err := enc.Encode(o); err != nil {
				p.log.Warn("write zds transcript", "error", err.Error())
			}
		}
	}
	c, err := zdsclient.New(cfg)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.zds = c
	p.mu.Unlock()
	return c.Run(ctx)
}

// DropZDS closes the ZDS connection (the pods' listeners stay), as when
// ztunnel's connection to the agent breaks; ServeZDS reconnects. It
// reports whether a connection was up.
func (p *Proxy) DropZDS() bool {
	p.mu.Lock()
	c := p.zds
	p.mu.Unlock()
	return c != nil && c.Drop()
}

// unreliable is a ztunnel slow to answer, that NACKs its first adds.
type unreliable struct {
	zdsclient.Handler
	delay time.Duration
	nacks atomic.Int64
}

func (u *unreliable) wait(ctx context.Context) error {
	select {
	case <-time.After(u.delay):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (u *unreliable) Add(ctx context.Context, uid string, info *zdsapi.WorkloadInfo, netns *os.File) error {
	if err := u.wait(ctx); err != nil {
		return err
	}
	if u.nacks.Add(-1) >= 0 {
		return errors.New("refused: the stand-in NACKs its first adds (Config.NackAdds)")
	}
	return u.Handler.Add(ctx, uid, info, netns)
}

func (u *unreliable) Keep(ctx context.Context, uid string) error {
	if err := u.wait(ctx); err != nil {
		return err
	}
	return u.Handler.Keep(ctx, uid)
}

func (u *unreliable) Del(ctx context.Context, uid string) error {
	if err := u.wait(ctx); err != nil {
		return err
	}
	return u.Handler.Del(ctx, uid)
}

func (u *unreliable) SnapshotSent(ctx context.Context, snapshot []string) error {
	if err := u.wait(ctx); err != nil {
		return err
	}
	return u.Handler.SnapshotSent(ctx, snapshot)
}
