// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standin

import (
	"context"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// ServeZDS receives pods from the node agent over ZDS at socketPath, as
// ztunnel does, reconnecting whenever the agent goes away, until ctx ends.
func (p *Proxy) ServeZDS(ctx context.Context, socketPath string) error {
	c, err := zdsclient.New(zdsclient.Config{SocketPath: socketPath, Handler: zdsclient.HandlerFor(p), Logger: p.log})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}
