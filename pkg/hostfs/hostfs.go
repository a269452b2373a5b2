// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package hostfs finds the host filesystems the data path needs: the cgroup
// v2 hierarchy (wherever this node mounted it) and a bpffs for pins.
package hostfs

import (
	"errors"
	"fmt"

	"github.com/moby/sys/mountinfo"
)

// ErrNotMounted is returned when no mount of the wanted type exists.
var ErrNotMounted = errors.New("not mounted")

func firstOfType(fstype string) (string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter(fstype))
	if err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	if len(mounts) == 0 {
		return "", fmt.Errorf("%s: %w", fstype, ErrNotMounted)
	}
	return mounts[0].Mountpoint, nil
}

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy
// (/sys/fs/cgroup on most nodes, /sys/fs/cgroup/unified on hybrid ones).
func Cgroup2Root() (string, error) {
	return firstOfType("cgroup2")
}
