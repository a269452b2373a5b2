// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
)

// checkFileLimit lifts the open file limit to its hard limit and weighs
// it against the data path's pod capacity. Below what loading and
// adopting the data path needs the agent refuses to start: it would run
// out part way, with errors about whatever pod it was at. Below what
// every pod starting at once needs it warns and runs: the data path
// holds no descriptor per pod, the need that remains is one connection
// per pod whose CNI ADD is in flight, and a node runs far fewer pods
// than the capacity (kubelet's default is 110), so refusing would take
// redirection management from a node that works.
func (a *agent) checkFileLimit() error {
	l, err := fdlimit.Raise()
	if err != nil {
		a.log.Warn("open file limit", "error", err)
		if l == (fdlimit.Limit{}) {
			return nil // unknown: nothing to weigh
		}
	}
	need := fdlimit.Need(bpfobj.MaxPods)
	warning, err := fdlimit.Check(l, bpfobj.MaxPods)
	if err != nil {
		return err
	}
	if warning != "" {
		a.log.Warn(warning, "limit", l.Soft, "hard", l.Hard, "need", need, "pods", bpfobj.MaxPods)
		return nil
	}
	a.log.Info("open file limit", "limit", l.Soft, "need", need, "pods", bpfobj.MaxPods)
	return nil
}
