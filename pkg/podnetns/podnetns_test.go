// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package podnetns

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"k8s.io/apimachinery/pkg/types"
)

func TestPodUIDFromCgroupLine(t *testing.T) {
	const uid = "0a1b2c3d-0000-4000-8000-00000000000a"
	cases := []struct {
		name, line string
		want       types.UID
	}{
		{"cgroup v2 containerd systemd besteffort", "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0a1b2c3d_0000_4000_8000_00000000000a.slice/cri-containerd-1234.scope", uid},
		{"cgroup v2 crio burstable", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0a1b2c3d_0000_4000_8000_00000000000a.slice/crio-1234.scope", uid},
		{"cgroup v2 guaranteed systemd", "0::/kubepods.slice/kubepods-pod0a1b2c3d_0000_4000_8000_00000000000a.slice/crio-1234.scope", uid},
		{"cgroup v1 cgroupfs besteffort", "4:memory:/kubepods/besteffort/pod0a1b2c3d-0000-4000-8000-00000000000a/1234", uid},
		{"cgroup v1 cgroupfs guaranteed", "3:cpu,cpuacct:/kubepods/pod0a1b2c3d-0000-4000-8000-00000000000a/1234", uid},
		{"nested under kind's kubelet.slice", "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod0a1b2c3d_0000_4000_8000_00000000000a.slice/cri-containerd-1.scope", uid},
		{"pod cgroup itself (pause in no container scope)", "0::/kubepods/besteffort/pod0a1b2c3d-0000-4000-8000-00000000000a", uid},
		{"host process", "0::/system.slice/containerd.service", ""},
		{"root cgroup", "0::/", ""},
		{"qos slice only", "0::/kubepods.slice/kubepods-besteffort.slice", ""},
		{"not a uuid", "0::/kubepods/besteffort/podnotauid/1234", ""},
		{"malformed line", "garbage", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := PodUIDFromCgroupLine(tc.line)
			if got != tc.want || ok != (tc.want != "") {
				t.Errorf("PodUIDFromCgroupLine(%q) = %q, %v; want %q", tc.line, got, ok, tc.want)
			}
		})
	}
}

func TestFindScansFakeProc(t *testing.T) {
	root := filepath.Join("testdata", "proc")
	cases := []struct {
		name string
		uid  types.UID
		pid  int // 0: not found
	}{
		{"containerd cgroup v2, lowest pid of the pod", "0a1b2c3d-0000-4000-8000-000000000001", 100},
		{"cgroup v1 cgroupfs", "0a1b2c3d-0000-4000-8000-000000000002", 200},
		{"crio cgroup v2", "0a1b2c3d-0000-4000-8000-000000000003", 300},
		{"guaranteed cgroupfs", "0a1b2c3d-0000-4000-8000-000000000004", 400},
		{"kind node", "0a1b2c3d-0000-4000-8000-000000000005", 500},
		{"process without a netns file (exited)", "0a1b2c3d-0000-4000-8000-000000000006", 0},
		{"unknown pod", "0a1b2c3d-0000-4000-8000-0000000000ff", 0},
	}
	f := New(root)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := f.Find(t.Context(), tc.uid)
			if tc.pid == 0 {
				if !errors.Is(err, ErrNotFound) {
					t.Fatalf("Find(%s) = %+v, %v; want ErrNotFound", tc.uid, got, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Find(%s): %v", tc.uid, err)
			}
			wantPath := filepath.Join(root, strconv.Itoa(tc.pid), "ns", "net")
			if got.PID != tc.pid || got.Path != wantPath {
				t.Errorf("Find(%s) = pid %d path %s; want pid %d path %s", tc.uid, got.PID, got.Path, tc.pid, wantPath)
			}
			fi, err := os.Stat(wantPath)
			if err != nil {
				t.Fatal(err)
			}
			if st := fi.Sys().(*syscall.Stat_t); got.Inode != st.Ino || got.Dev != uint64(st.Dev) { //nolint:unconvert // arch-dependent
				t.Errorf("Find(%s) dev/inode = %d/%d; want %d/%d", tc.uid, got.Dev, got.Inode, st.Dev, st.Ino)
			}
		})
	}
}

func TestScanFindsEveryPodOnce(t *testing.T) {
	found, err := New(filepath.Join("testdata", "proc")).Scan(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := map[types.UID]int{
		"0a1b2c3d-0000-4000-8000-000000000001": 100, "0a1b2c3d-0000-4000-8000-000000000002": 200,
		"0a1b2c3d-0000-4000-8000-000000000003": 300, "0a1b2c3d-0000-4000-8000-000000000004": 400,
		"0a1b2c3d-0000-4000-8000-000000000005": 500,
	}
	if len(found) != len(want) {
		t.Errorf("Scan = %+v; want the pods %v", found, want)
	}
	for uid, pid := range want {
		if found[uid].PID != pid {
			t.Errorf("Scan: pod %s at pid %d; want %d", uid, found[uid].PID, pid)
		}
	}
}

// A scan stops at once when its context ends: an agent told to stop does
// not read thousands of processes' cgroups first.
func TestScanStopsWhenTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if found, err := New(filepath.Join("testdata", "proc")).Scan(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Scan with an ended context = %+v, %v; want context.Canceled", found, err)
	}
}

// What a scan found stays current while the process is the pod's, and
// stops being so once the PID names another pod, none, or no process.
func TestCurrentRechecksOneProcess(t *testing.T) {
	root := t.TempDir()
	const uid = "0a1b2c3d-0000-4000-8000-000000000001"
	writeProc := func(pid, cgroup string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Join(root, pid, "ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, pid, "cgroup"), []byte(cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(root, pid, "ns", "net"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeProc("42", "0::/kubepods/besteffort/pod"+uid+"/1\n")
	f := New(root)
	found, err := f.Scan(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	ns := found[uid]
	if !f.Current(uid, ns) {
		t.Fatalf("Current(%+v) = false right after the scan", ns)
	}
	if f.Current("0a1b2c3d-0000-4000-8000-000000000002", ns) {
		t.Error("Current holds for another pod's UID")
	}
	// The PID reused by a process of no pod.
	writeProc("42", "0::/system.slice/containerd.service\n")
	if f.Current(uid, ns) {
		t.Error("Current holds after the PID went to a process of no pod")
	}
	// The process gone.
	if err := os.RemoveAll(filepath.Join(root, "42")); err != nil {
		t.Fatal(err)
	}
	if f.Current(uid, ns) {
		t.Error("Current holds after the process exited")
	}
}

func TestFindOwnProcessInRealProc(t *testing.T) {
	// This test process is in no pod cgroup (unless the suite itself runs
	// in a pod), so the real /proc must scan cleanly and find nothing.
	if _, err := New("").Find(t.Context(), "0a1b2c3d-0000-4000-8000-0000000000ff"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Find in /proc: %v; want ErrNotFound", err)
	}
}

func TestFindMissingProcRoot(t *testing.T) {
	if _, err := New(filepath.Join(t.TempDir(), "none")).Find(t.Context(), "x"); err == nil || errors.Is(err, ErrNotFound) {
		t.Errorf("Find over a missing proc root: %v; want a scan error", err)
	}
}
