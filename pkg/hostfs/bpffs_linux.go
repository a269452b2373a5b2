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
