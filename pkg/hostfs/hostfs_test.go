// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package hostfs

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// Cgroup2Root finds this process's cgroup v2 hierarchy in its mountinfo.
func TestCgroup2RootIsACgroup2Mount(t *testing.T) {
	root, err := Cgroup2Root()
	if err != nil {
		t.Fatalf("Cgroup2Root: %v (the suites need a cgroup v2 hierarchy)", err)
	}
	if _, err := CgroupID(root); err != nil {
		t.Errorf("Cgroup2Root = %s: %v", root, err)
	}
}

func TestNoMountOfAType(t *testing.T) {
	if _, err := firstOfType("no-such-filesystem"); !errors.Is(err, ErrNotMounted) {
		t.Errorf("firstOfType of an absent type = %v, want ErrNotMounted", err)
	}
}

// tmpfsAt mounts a tmpfs on a directory of the test with the given
// propagation (unix.MS_SHARED or unix.MS_PRIVATE), removed with whatever
// was mounted below it.
func tmpfsAt(t *testing.T, propagation uintptr) string {
	t.Helper()
	testenv.RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs on %s: %v", dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	if err := unix.Mount("", dir, "", propagation, ""); err != nil {
		t.Fatalf("set propagation of %s: %v", dir, err)
	}
	return dir
}

// A bpffs is mounted where none is only when the mount reaches the host
// (a shared mount: a privileged pod's Bidirectional volume); below a mount
// that does not propagate (HostToContainer, or private) it is refused with
// what to do, and nothing is mounted. An existing bpffs is kept as it is.
func TestEnsureBPFFSMountsOnlyWhereTheMountReachesTheHost(t *testing.T) {
	t.Run("shared", func(t *testing.T) {
		mnt := filepath.Join(tmpfsAt(t, unix.MS_SHARED), "bpf")
		mounted, err := EnsureBPFFS(mnt)
		if err != nil || !mounted {
			t.Fatalf("EnsureBPFFS below a shared mount = %v, %v; want a bpffs mounted", mounted, err)
		}
		t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
		if ok, err := IsBPFFS(mnt); !ok || err != nil {
			t.Fatalf("after EnsureBPFFS, %s is a bpffs: %v, %v", mnt, ok, err)
		}
		if mounted, err := EnsureBPFFS(mnt); err != nil || mounted {
			t.Errorf("EnsureBPFFS on a bpffs = %v, %v; want nothing done", mounted, err)
		}
	})
	t.Run("private", func(t *testing.T) {
		mnt := filepath.Join(tmpfsAt(t, unix.MS_PRIVATE), "bpf")
		mounted, err := EnsureBPFFS(mnt)
		if err == nil || mounted || !strings.Contains(err.Error(), "mount -t bpf bpf "+mnt) || !strings.Contains(err.Error(), "privileged") {
			t.Fatalf("EnsureBPFFS below a private mount = %v, %v; want a refusal saying what to do", mounted, err)
		}
		if ok, _ := IsBPFFS(mnt); ok {
			t.Errorf("%s was mounted although refused", mnt)
		}
	})
}
