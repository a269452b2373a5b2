// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standin

import (
	"context"
	"encoding/json"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// ServeZDS receives pods from the node agent over ZDS at socketPath, as
// ztunnel does, reconnecting whenever the agent goes away, until ctx ends;
// each request goes to Config.Transcript as it arrives.
func (p *Proxy) ServeZDS(ctx context.Context, socketPath string) error {
	cfg := zdsclient.Config{SocketPath: socketPath, Handler: zdsclient.HandlerFor(p), Logger: p.log}
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
	return c.Run(ctx)
}
