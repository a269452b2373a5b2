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

func TestPodUIDOfCgroup(t *testing.T) {
	const uid = "0cec9733-4eb4-435b-bdb4-c865cd115962"
	for _, c := range []struct {
		path, want string
	}{
		{"/kubepods/burstable/pod" + uid + "/cri-containerd-abc", uid},
		{"/kubepods/pod" + uid, uid},
		{"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0cec9733_4eb4_435b_bdb4_c865cd115962.slice/cri-containerd-1.scope", uid},
		{"/kubepods.slice/kubepods-pod0cec9733_4eb4_435b_bdb4_c865cd115962.slice", uid},
		{"/../../kubepods/besteffort/pod" + uid + "/x", uid},
		{"/kubepods/burstable", ""},
		{"/kubepods.slice/kubepods-burstable.slice", ""},
		{"/system.slice/podman-1.scope", ""},
		{"/kubepods/pod../etc", ""},
	} {
		got, ok := PodUIDOfCgroup(c.path)
		if got != c.want || ok != (c.want != "") {
			t.Errorf("PodUIDOfCgroup(%q) = %q, %v; want %q", c.path, got, ok, c.want)
		}
	}
}

func TestUnifiedCgroupPath(t *testing.T) {
	for _, c := range []struct {
		content, want string
	}{
		{"0::/kubepods/pod1/x\n", "/kubepods/pod1/x"},
		{"12:cpu,cpuacct:/a\n1:name=systemd:/b\n0::/c/../d\n", "/d"},
		{"12:cpu:/a\n", ""},
		{"0::relative\n", ""},
	} {
		got, ok := UnifiedCgroupPath(c.content)
		if got != c.want || ok != (c.want != "") {
			t.Errorf("UnifiedCgroupPath(%q) = %q, %v; want %q", c.content, got, ok, c.want)
		}
	}
}

// A process's /proc/<pid>/cgroup names cgroups whoever made them chose:
// the parsers never panic, and a UID they return never leaves the
// directory it is joined to.
func FuzzCgroupPath(f *testing.F) {
	f.Add("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1_2.slice/c.scope\n")
	f.Add("0::/../pod/../pod..\n1:name=systemd:/x\n")
	f.Fuzz(func(t *testing.T, content string) {
		path, ok := UnifiedCgroupPath(content)
		if !ok {
			return
		}
		if uid, ok := PodUIDOfCgroup(path); ok && (strings.ContainsAny(uid, "/.") || uid == "") {
			t.Fatalf("PodUIDOfCgroup(%q) = %q", path, uid)
		}
	})
}
