// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package hostfs

import (
	"fmt"
	"os"

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

// EnsureBPFFS makes sure mountPoint holds a bpffs, mounting one when the
// directory exists on another filesystem (nodes that never mounted it).
func EnsureBPFFS(mountPoint string) error {
	if err := os.MkdirAll(mountPoint, 0o700); err != nil {
		return fmt.Errorf("create bpffs mount point: %w", err)
	}
	ok, err := IsBPFFS(mountPoint)
	if err != nil || ok {
		return err
	}
	if err := unix.Mount("bpf", mountPoint, "bpf", 0, "mode=0700"); err != nil {
		return fmt.Errorf("mount bpffs on %s: %w", mountPoint, err)
	}
	return nil
}
