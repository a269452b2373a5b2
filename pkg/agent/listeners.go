// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// listenerResyncInterval is how often the agent files the inbound
// listeners of enrolled pods that have none filed (a full ae_listeners
// left them out) and prunes those of netns that are not enrolled.
const listenerResyncInterval = 30 * time.Second

// listenerResyncer is the data path's side (*dataplane.Dataplane).
type listenerResyncer interface {
	ResyncListeners(ctx context.Context) (inspect.ListenerStatus, error)
}

// resyncListeners runs dp's listener resync at start and then every
// listenerResyncInterval until ctx ends, and keeps its metrics current.
// Sockops files a listener only as it starts listening: one the table had
// no room for would otherwise wait for ztunnel to open it again, its
// pod's inbound connections refused meanwhile.
func (a *agent) resyncListeners(ctx context.Context, dp listenerResyncer) {
	t := time.NewTicker(listenerResyncInterval)
	defer t.Stop()
	for {
		st, err := dp.ResyncListeners(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			a.log.Warn("resync ztunnel's inbound listeners", "error", err)
		default:
			a.metrics.observeListeners(st)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
