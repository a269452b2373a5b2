// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// A node reboot without drain (issue 33), in three steps the caller
// orders: PowerOff ends every process of the node at once, WipeVolatile
// removes what a reboot removes and keeps what is on disk, and the caller
// starts the runtime (StartContainerd), kubelet (Kubelet.Start) and the
// rest in the order it tests.

// Kill ends the process with SIGKILL and waits for it.
func (p *Proc) Kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// PowerOff ends the node as a power cut does, SIGKILL and no warning:
// containerd, its shims, and every process of the node's cgroup subtree
// (kubelet, the containers, the agent, ztunnel). Processes the caller
// started elsewhere are the caller's to end first.
func (n *Node) PowerOff() {
	n.t.Helper()
	if n.containerd != nil {
		n.containerd.Kill()
	}
	n.killShims()
	if err := n.killCgroupProcs(20 * time.Second); err != nil {
		n.t.Fatalf("power off: %v", err)
	}
}

// killCgroupProcs ends every process of the node's cgroup v2 subtree
// with SIGKILL, until none is left or timeout.
func (n *Node) killCgroupProcs(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		pids, err := cgroupProcs(n.Cgroup2)
		if err != nil || len(pids) == 0 {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes %v of %s outlived SIGKILL for %s", pids, n.Cgroup2, timeout)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cgroupProcs lists the processes of a cgroup v2 directory and every
// cgroup below it.
func cgroupProcs(dir string) ([]int, error) {
	var pids []int
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil
			}
			return err
		}
		if !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read %s/cgroup.procs: %w", p, err)
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids, err
}

// WipeVolatile does to the powered-off node what its reboot does: memory
// and /run are gone, the disk stays.
//
// Gone: every mount the runtime and kubelet made (pods' netns, rootfs,
// shm, volumes), the bpffs contents (a fresh bpffs is mounted), the
// runtime's state and runc's root, the agent's run directory and ztunnel's
// socket directory, the shims' sockets, and every cgroup below the node's
// cgroup parent in each hierarchy. With their netns gone, the pods' veths
// and everything attached to them go; with the bpffs gone and no process
// left, so do the agent's links at the node's cgroup.
//
// Kept: the runtime's root (images, its metadata of the old sandboxes),
// kubelet's root and pod logs, the CNI directories and the primary CNI's
// IPAM state, the node netns itself (the node's interfaces).
func (n *Node) WipeVolatile() {
	t := n.t
	t.Helper()
	// The shims' sockets are in the machine's /run/containerd/s, named in
	// each task's bundle: read them before the bundles go.
	addrs, _ := filepath.Glob(filepath.Join(n.Dir, "state", "io.containerd.runtime.v2.task", "*", "*", "address"))
	for _, a := range addrs {
		if b, err := os.ReadFile(a); err == nil {
			sock := strings.TrimPrefix(strings.TrimSpace(string(b)), "unix://")
			if strings.HasPrefix(sock, shimSocketDir+"/") {
				_ = os.Remove(sock)
			}
		}
	}

	// Every mount below the node's directory but the test's own (the node
	// netns, the bpffs, the shared netns directory), deepest first.
	for {
		below, err := mountsBelow(n.Dir)
		if err != nil {
			t.Fatal(err)
		}
		below = slices.DeleteFunc(below, n.mounted)
		if len(below) == 0 {
			break
		}
		for _, m := range below {
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				t.Fatalf("reboot: unmount %s: %v", m, err)
			}
		}
	}
	// A fresh bpffs: unmount whatever is stacked there, mount a new one.
	for isMountPoint(n.BPFFS) {
		if err := unix.Unmount(n.BPFFS, unix.MNT_DETACH); err != nil {
			t.Fatalf("reboot: unmount the bpffs %s: %v", n.BPFFS, err)
		}
	}
	if err := unix.Mount("bpf", n.BPFFS, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("reboot: mount a bpffs on %s: %v", n.BPFFS, err)
	}
	if err := unix.Mount("", n.BPFFS, "", unix.MS_SHARED, ""); err != nil {
		t.Fatalf("reboot: make %s shared: %v", n.BPFFS, err)
	}

	// /run: the runtime's state (the netns directory's mount stays, its
	// files go), runc's root, the sockets, the agent's and ztunnel's.
	clear := func(dir string, except ...string) {
		ents, err := os.ReadDir(dir)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("reboot: %v", err)
		}
		for _, e := range ents {
			p := filepath.Join(dir, e.Name())
			if slices.Contains(except, p) {
				continue
			}
			if err := os.RemoveAll(p); err != nil {
				t.Fatalf("reboot: remove %s: %v", p, err)
			}
		}
	}
	cri := filepath.Join(n.Dir, "state", "io.containerd.grpc.v1.cri")
	clear(filepath.Join(n.Dir, "state"), cri)
	clear(cri, n.NetnsDir)
	clear(n.NetnsDir)
	for _, d := range []string{filepath.Join(n.Dir, "runc"), filepath.Join(n.Dir, "ambient-ebpf"), n.ZtunnelSocketDir()} {
		clear(d)
	}
	for _, f := range []string{n.Socket, filepath.Join(n.Dir, "containerd-ttrpc.sock")} {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("reboot: %v", err)
		}
	}
	if err := n.removeCgroupsBelow(); err != nil {
		t.Fatalf("reboot: %v", err)
	}
}

// mountsBelow lists the mount points strictly below dir, deepest first.
func mountsBelow(dir string) ([]string, error) {
	mounts, err := hostfs.Mounts()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range mounts {
		if strings.HasPrefix(m.MountPoint, dir+"/") && !slices.Contains(out, m.MountPoint) {
			out = append(out, m.MountPoint)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out, nil
}

// isMountPoint reports whether dir is a mount point.
func isMountPoint(dir string) bool {
	mounts, err := hostfs.Mounts()
	if err != nil {
		return false
	}
	return slices.ContainsFunc(mounts, func(m hostfs.Mount) bool { return m.MountPoint == dir })
}
