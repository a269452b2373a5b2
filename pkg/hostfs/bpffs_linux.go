// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package hostfs

import (
	"fmt"
	"os"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// IsBPFFS reports whether path is on a bpf filesystem.
func IsBPFFS(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return st.Type == unix.BPF_FS_MAGIC, nil
}

// CgroupID returns the id of the cgroup v2 directory at path (its inode
// number, which is what the kernel reports as a cgroup link's cgroup id),
// or an error when path is not a directory of a cgroup v2 hierarchy.
func CgroupID(path string) (uint64, error) {
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil {
		return 0, fmt.Errorf("statfs %s: %w", path, err)
	}
	if fs.Type != unix.CGROUP2_SUPER_MAGIC {
		return 0, fmt.Errorf("%s is not a cgroup v2 directory (filesystem magic %#x)", path, fs.Type)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Ino, nil
}

// EnsureBPFFS makes sure mountPoint holds a bpffs. Where it holds another
// filesystem (a node that never mounted one), a bpffs is mounted there, but
// only when that mount reaches the host: the mount mountPoint is on must
// propagate to its peers (shared, as a privileged pod's Bidirectional
// volume is). A bpffs that stayed in the agent's own mount namespace would
// go with its container, and with it every pin, so every link: redirection
// would stop at the agent's first restart. It reports whether it mounted.
func EnsureBPFFS(mountPoint string) (mounted bool, err error) {
	if err := os.MkdirAll(mountPoint, 0o700); err != nil {
		return false, fmt.Errorf("create bpffs mount point: %w", err)
	}
	ok, err := IsBPFFS(mountPoint)
	if err != nil || ok {
		return false, err
	}
	parent, err := mountOf(mountPoint)
	if err != nil {
		return false, err
	}
	if !isShared(parent.Optional) {
		return false, fmt.Errorf("%s is not a bpffs, and a bpffs mounted there would not reach the host (mount %s does not propagate: %q): "+
			"mount one on the host (mount -t bpf bpf %s) or run the agent privileged (Bidirectional mount propagation)",
			mountPoint, parent.Mountpoint, parent.Optional, mountPoint)
	}
	if err := unix.Mount("bpf", mountPoint, "bpf", 0, "mode=0700"); err != nil {
		return false, fmt.Errorf("mount bpffs on %s: %w", mountPoint, err)
	}
	return true, nil
}

// mountOf returns the mount path is on: the deepest mount point above it.
func mountOf(path string) (*mountinfo.Info, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.ParentsFilter(path))
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	var best *mountinfo.Info
	for _, m := range mounts {
		if best == nil || len(m.Mountpoint) >= len(best.Mountpoint) {
			best = m
		}
	}
	if best == nil {
		return nil, fmt.Errorf("no mount holds %s", path)
	}
	return best, nil
}

// isShared reports whether a mount's optional fields (mountinfo's seventh
// column) put it in a peer group: "shared:N".
func isShared(optional string) bool {
	for _, f := range strings.Fields(optional) {
		if strings.HasPrefix(f, "shared:") {
			return true
		}
	}
	return false
}
