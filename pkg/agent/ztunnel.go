// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"fmt"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// attachZtunnel gives the cgroup of a ztunnel that just said hello the
// socket programs, with per-pod socket hooks (dataplane.SocketHooksPods),
// before it is handed any pod: its listeners, its reads of original
// destinations and its connections to its pods' apps need them. Its
// cgroup is its pod's when the path in /proc names one (found below the
// pods' cgroup, whatever cgroup namespace the agent runs in), else its
// own below the cgroup v2 mount. An error refuses the connection;
// ztunnel connects again.
func (a *agent) attachZtunnel(dp *dataplane.Dataplane, p zds.Peer) error {
	if a.cfg.Dataplane.SocketHooks != dataplane.SocketHooksPods {
		return nil
	}
	if p.PID == 0 {
		return errors.New("its process is not in the agent's PID namespace, so its cgroup is unknown: run the agent with hostPID for --socket-hooks=pods")
	}
	mount, err := hostfs.Cgroup2Root()
	if err != nil {
		return fmt.Errorf("find the cgroup v2 mount: %w", err)
	}
	cg, err := hostfs.ProcessCgroup(a.cfg.ProcRoot, p.PID, mount, a.cfg.Dataplane.PodsCgroup)
	if err != nil {
		return err
	}
	if err := dp.AttachZtunnel(cg); err != nil {
		return err
	}
	a.log.Info("ztunnel's cgroup has the socket programs", "pid", p.PID, "cgroup", cg)
	return nil
}
