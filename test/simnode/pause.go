// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// Pause is a pod's pause process: what an agent that looks for pods'
// netns in /proc finds (istio-cni after a restart).
type Pause struct {
	Process *Process
	// Cgroup is the sandbox's cgroup: pod<uid>/<container id> below the
	// node's pods cgroup, as a cgroupfs kubelet and runc lay it out, which
	// is what such agents parse the pod's UID and the container's ID from.
	Cgroup string
}

// StartPause starts the pod's pause process (sleep) in its netns, in a
// sandbox cgroup below the pod's (created here, with the pod's if
// missing; the container ID is derived from the pod's UID) and, unless
// pidns is 0, in the PID namespace of process pidns (entered with nsenter
// --pid), as a pod's processes are in the PID namespace the node's agent
// sees. It ends by Stop, or at t's cleanup.
func (n *Node) StartPause(p *Pod, pidns int) *Pause {
	n.t.Helper()
	if p.Cgroup == "" {
		p.Cgroup = filepath.Join(n.PodsCgroup, "pod"+p.UID)
	}
	sum := sha256.Sum256([]byte(p.UID))
	ps := &Pause{Cgroup: filepath.Join(p.Cgroup, hex.EncodeToString(sum[:]))}
	for _, cg := range []string{p.Cgroup, ps.Cgroup} {
		if err := os.Mkdir(cg, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			n.t.Fatalf("cgroup of pod %s: %v", p.Name, err)
		}
	}
	argv := []string{"sleep", "infinity"}
	if pidns != 0 {
		argv = append([]string{"nsenter", "--target", strconv.Itoa(pidns), "--pid", "--"}, argv...)
	}
	ps.Process = StartProcess(n.t, p.NS, ps.Cgroup, argv...)
	// Running once sleep is in the cgroup (nsenter forks it): an agent
	// that looks for the pod right after must find it, as it finds a
	// real pod's pause process, which runs long before.
	if !testenv.Poll(10*time.Second, func() bool { return ps.sleeping() || ps.Process.Exited() }) || ps.Process.Exited() {
		n.t.Fatalf("pause process of pod %s did not start: %s", p.Name, ps.Process.Output.String())
	}
	// Before the process's own cleanup: a sleep left by nsenter holds
	// its output pipe, and its wait with it.
	n.t.Cleanup(func() {
		if err := ps.Stop(); err != nil {
			n.t.Errorf("pause process of pod %s: %v", p.Name, err)
		}
	})
	return ps
}

// sleeping says whether a process of the sandbox's cgroup runs sleep.
func (ps *Pause) sleeping() bool {
	b, err := os.ReadFile(filepath.Join(ps.Cgroup, "cgroup.procs"))
	if err != nil {
		return false
	}
	for _, pid := range strings.Fields(string(b)) {
		if comm, err := os.ReadFile("/proc/" + pid + "/comm"); err == nil && strings.TrimSpace(string(comm)) == "sleep" {
			return true
		}
	}
	return false
}

// Stop ends the pause process through its cgroup (nsenter passes no
// signal on to the process it forked) and removes the sandbox's cgroup;
// the pod's stays. Stopping again does nothing.
func (ps *Pause) Stop() error {
	if err := os.WriteFile(filepath.Join(ps.Cgroup, "cgroup.kill"), []byte("1"), 0o644); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("kill the processes of cgroup %s: %w", ps.Cgroup, err)
	}
	ps.Process.Terminate(5 * time.Second)
	return RemoveCgroup(ps.Cgroup)
}

// RemoveCgroup removes an empty cgroup; one already gone is fine. A
// process that just died may hold it for a moment (EBUSY).
func RemoveCgroup(cg string) error {
	var err error
	for range 200 {
		if err = unix.Rmdir(cg); err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) {
			break
		}
		sleepShort()
	}
	return fmt.Errorf("remove cgroup %s: %w", cg, err)
}
