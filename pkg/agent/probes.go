// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// probeSweeper is the data path's side (*dataplane.Dataplane).
type probeSweeper interface {
	SweepProbeFlows() (int, error)
}

// sweepProbeFlows runs dp's sweep of the host-probe flows no SYN used every
// bpfobj.ProbeFlowTTL until ctx ends. The pod's programs remove the flows
// they pass and honour none older than that, so what is left is a probe
// whose SYN never reached the pod; without the sweep such entries would
// fill ae_probe_nat over the node's life.
func (a *agent) sweepProbeFlows(ctx context.Context, dp probeSweeper) {
	t := time.NewTicker(bpfobj.ProbeFlowTTL)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := dp.SweepProbeFlows()
		switch {
		case err != nil && ctx.Err() == nil:
			a.log.Warn("sweep host-probe flows no SYN used", "error", err)
		case n > 0:
			a.log.Debug("swept host-probe flows no SYN used", "entries", n)
		}
	}
}
