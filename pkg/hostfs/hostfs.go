// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package hostfs finds the host filesystems the data path needs: the cgroup
// v2 hierarchy (wherever this node mounted it) and a bpffs for pins.
package hostfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/moby/sys/mountinfo"
)

// ErrNotMounted is returned when no mount of the wanted type exists.
var ErrNotMounted = errors.New("not mounted")

// Mount is one mount of the calling process's mount table, reduced to what
// the data path and the node preflight use.
type Mount struct {
	MountPoint string
	FSType     string
}

// Mounts reads the calling process's mount table.
func Mounts() ([]Mount, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	out := make([]Mount, len(infos))
	for i, m := range infos {
		out[i] = Mount{MountPoint: m.Mountpoint, FSType: m.FSType}
	}
	return out, nil
}

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

// PodsCgroup is the cgroup kubelet puts every pod in, right below the
// cgroup v2 directory root: kubepods.slice (the systemd driver) or
// kubepods (cgroupfs); "" when neither is there.
func PodsCgroup(root string) string {
	for _, name := range []string{"kubepods.slice", "kubepods"} {
		if fi, err := os.Stat(filepath.Join(root, name)); err == nil && fi.IsDir() {
			return filepath.Join(root, name)
		}
	}
	return ""
}
