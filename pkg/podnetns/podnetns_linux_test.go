// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package podnetns

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"k8s.io/apimachinery/pkg/types"
)

// TestFindsRealProcessInPodCgroupAndNetns puts a process in its own netns
// into a cgroup named like a kubelet pod cgroup, and finds it through the
// real /proc.
func TestFindsRealProcessInPodCgroupAndNetns(t *testing.T) {
	testenv.RequireRoot(t)
	uid := types.UID("0a1b2c3d-0000-4000-8000-" + "0000" + testenv.RunID())
	cg := podCgroup(t, uid)

	cmd := exec.Command("unshare", "--net", "sleep", "60")
	if err := cmd.Start(); err != nil {
		testenv.SkipOrFail(t, "unshare: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	// unshare execs sleep in the same process once the netns is made.
	for range 200 {
		if self, _ := os.Readlink("/proc/self/ns/net"); self != "" {
			if other, _ := os.Readlink("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/ns/net"); other != "" && other != self {
				break
			}
		}
		syscall.Nanosleep(&syscall.Timespec{Nsec: 5e6}, nil) //nolint:errcheck // a short pause
	}
	if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(cmd.Process.Pid)), 0o644); err != nil {
		t.Fatalf("move pid %d into %s: %v", cmd.Process.Pid, cg, err)
	}

	got, err := New("/proc").Find(t.Context(), uid)
	if err != nil {
		t.Fatalf("Find(%s): %v", uid, err)
	}
	if got.PID != cmd.Process.Pid {
		t.Errorf("Find pid = %d; want %d", got.PID, cmd.Process.Pid)
	}
	var own, pod syscall.Stat_t
	if err := syscall.Stat("/proc/self/ns/net", &own); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Stat("/proc/"+strconv.Itoa(cmd.Process.Pid)+"/ns/net", &pod); err != nil {
		t.Fatal(err)
	}
	if got.Inode != pod.Ino || got.Inode == own.Ino {
		t.Errorf("Find inode = %d; want the pod netns %d (the test's own is %d)", got.Inode, pod.Ino, own.Ino)
	}
}

// podCgroup makes /kubepods/besteffort/pod<uid> in the first cgroup
// hierarchy that takes it (cgroup v2, or v1 pids) and removes it afterwards.
func podCgroup(t *testing.T, uid types.UID) string {
	t.Helper()
	for _, root := range []string{"/sys/fs/cgroup/unified", "/sys/fs/cgroup", "/sys/fs/cgroup/pids"} {
		if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err != nil {
			continue
		}
		parent := filepath.Join(root, "kubepods-test-"+testenv.RunID())
		dir := filepath.Join(parent, "besteffort", "pod"+string(uid))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			continue
		}
		t.Cleanup(func() {
			// Children first; the process is gone by then (cleanups run in reverse).
			for d := dir; d != root; d = filepath.Dir(d) {
				_ = os.Remove(d)
			}
		})
		return dir
	}
	testenv.SkipOrFail(t, "no writable cgroup hierarchy")
	return ""
}

func TestSameTellsNetnsPathsApartByInode(t *testing.T) {
	f := New("")
	self := "/proc/self/ns/net"
	byPID := "/proc/" + strconv.Itoa(os.Getpid()) + "/ns/net"
	cases := []struct {
		a, b        string
		same, known bool
	}{
		{self, self, true, true},
		{self, byPID, true, true},
		{self, "/proc/self/ns/mnt", false, true},
		{self, filepath.Join(t.TempDir(), "gone"), false, false},
	}
	for _, tc := range cases {
		if same, known := f.Same(tc.a, tc.b); same != tc.same || known != tc.known {
			t.Errorf("Same(%s, %s) = %v, %v; want %v, %v", tc.a, tc.b, same, known, tc.same, tc.known)
		}
	}
}

// All lists each netns once, a named one under its name first, then the
// processes' under the proc root.
func TestAllListsEachNetnsOnceNamedFirst(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink("/proc/self/ns/net", filepath.Join(dir, "mine")); err != nil {
		t.Fatal(err)
	}
	all := (&Finder{ProcRoot: "/proc", NetnsDir: dir}).All()
	if len(all) == 0 || all[0].Path != filepath.Join(dir, "mine") || all[0].PID != 0 {
		t.Fatalf("All()[0] = %+v; want the named netns", all)
	}
	seen := map[[2]uint64]string{}
	for _, ns := range all {
		k := [2]uint64{ns.Dev, ns.Inode}
		if other, dup := seen[k]; dup {
			t.Errorf("netns %v listed as %s and %s", k, other, ns.Path)
		}
		seen[k] = ns.Path
		if ns.Path != all[0].Path && (ns.PID <= 0 || !strings.HasPrefix(ns.Path, "/proc/")) {
			t.Errorf("entry %+v: want a process's netns under /proc", ns)
		}
	}
}
