// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func perPodConfig(n *simnode.Node) Config {
	return Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, PodsCgroup: n.PodsCgroup, SocketHooks: SocketHooksPods,
		NodeNetns: simnode.NetnsPath(n.NodeNS)}
}

// With per-pod socket hooks, a pod not in the mesh has no program of ours
// on its cgroup or above it (but the node-wide half on the root, where the
// kernel refuses fentry on tcp_connect); an
// enrolled pod and ztunnel have the full set on theirs, once, across
// restarts; a removal, ztunnel's cgroup going and the uninstall leave
// nothing. (Where each contract row's traffic goes with them:
// test/conformance, backend ebpf-pods.)
func TestPerPodSocketHooksLeaveBystandersAlone(t *testing.T) {
	n := simnode.New(t)
	a, c := n.AddPod("a"), n.AddPod("c")
	full, half := len(bpfobj.CgroupHooks()), len(bpfobj.NodeScopeHooks())
	d, err := New(perPodConfig(n))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if d.probesAtConnect() {
		half = 0 // host probes filed at tcp_connect: nothing on the root
	}
	ztcg := n.ZtunnelCgroup()
	if err := d.AttachZtunnel(ztcg); err != nil {
		t.Fatal(err)
	}
	if err := d.Enroll(context.Background(), podOf(a)); err != nil {
		t.Fatal(err)
	}
	check := func(when string, want map[string]int) {
		t.Helper()
		for dir, n := range want {
			if got := simnode.SocketProgramsOn(t, dir); got != n {
				t.Errorf("%s: %d programs on %s, want %d", when, got, dir, n)
			}
		}
	}
	check("enrolled", map[string]int{n.CgroupRoot: half, n.PodsCgroup: 0, a.Cgroup: full, c.Cgroup: 0, ztcg: full})
	// doctor names them ours.
	progs, _, err := inspect.CgroupPrograms(n.CgroupRoot, n.BPFFSDir, 100)
	if err != nil {
		t.Fatal(err)
	}
	ours := map[string]int{}
	for _, p := range progs {
		if p.Ours {
			ours[p.Cgroup]++
		}
	}
	if ours[a.Cgroup] != full || ours[ztcg] != full || ours[n.CgroupRoot] != half {
		t.Errorf("doctor's view counts as ours %v; want %d on the pod's and ztunnel's cgroups, %d on the root", ours, full, half)
	}

	// Again, and after a restart: nothing twice.
	if err := d.AttachZtunnel(ztcg); err != nil {
		t.Fatal(err)
	}
	if err := d.Enroll(context.Background(), podOf(a)); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if d, err = New(perPodConfig(n)); err != nil {
		t.Fatalf("New after a restart: %v", err)
	}
	check("restarted", map[string]int{n.CgroupRoot: half, n.PodsCgroup: 0, a.Cgroup: full, c.Cgroup: 0, ztcg: full})

	// ztunnel replaced: the old cgroup's pins go with the next attach.
	next := n.PodsCgroupDir("ztunnel-2")
	if err := os.Remove(ztcg); err != nil {
		t.Fatalf("remove ztunnel's cgroup: %v", err)
	}
	// The kernel detaches a removed cgroup's links from a work queue.
	ztPins, _ := os.ReadDir(bpfobj.ZtunnelDir(n.BPFFSDir))
	pin := filepath.Join(bpfobj.ZtunnelDir(n.BPFFSDir), ztPins[0].Name(), bpfobj.CgroupHooks()[0].Name)
	if !testenv.Poll(5*time.Second, func() bool { live, err := cgroupLinkLive(pin); return err == nil && !live }) {
		t.Fatal("the links of a removed cgroup still read as attached")
	}
	if err := d.AttachZtunnel(next); err != nil {
		t.Fatal(err)
	}
	if dirs, _ := os.ReadDir(bpfobj.ZtunnelDir(n.BPFFSDir)); len(dirs) != 1 {
		t.Errorf("%d ztunnel cgroups pinned, want 1", len(dirs))
	}
	check("ztunnel replaced", map[string]int{next: full})

	if err := d.Remove(context.Background(), a.UID); err != nil {
		t.Fatal(err)
	}
	check("removed", map[string]int{a.Cgroup: 0, n.CgroupRoot: half})

	// A pod whose cgroup is nowhere is refused, naming where it looked.
	lost := podOf(c)
	lost.UID = "no-such-pod"
	if err := d.Enroll(context.Background(), lost); err == nil || !strings.Contains(err.Error(), "no cgroup of pod uid no-such-pod below "+n.PodsCgroup) {
		t.Errorf("Enroll of a pod without a cgroup: %v", err)
	}
	if err := d.AttachZtunnel(n.CgroupRoot); err == nil {
		t.Error("AttachZtunnel took a cgroup outside the pods cgroup")
	}
	if err := d.Uninstall(); err != nil {
		t.Fatal(err)
	}
	check("uninstalled", map[string]int{n.CgroupRoot: 0, a.Cgroup: 0, next: 0})
}

// The shared socket hooks with a pod enrolled are not switched to per-pod
// ones (ztunnel's reads would meet no program until it connects again):
// New refuses, naming what to do, and leaves the pins as they were. The
// other way the switch is in place: the shared set attaches, then each
// pod's and ztunnel's links go.
func TestSocketHooksSwitch(t *testing.T) {
	n := simnode.New(t)
	a := n.AddPod("a")
	shared := perPodConfig(n)
	shared.SocketHooks = SocketHooksShared
	full := len(bpfobj.CgroupHooks())

	d, err := New(perPodConfig(n))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if err := d.AttachZtunnel(n.ZtunnelCgroup()); err != nil {
		t.Fatal(err)
	}
	if err := d.Enroll(context.Background(), podOf(a)); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if d, err = New(shared); err != nil {
		t.Fatalf("New with shared hooks over per-pod ones: %v", err)
	}
	for dir, want := range map[string]int{n.PodsCgroup: full, a.Cgroup: 0, n.ZtunnelCgroup(): 0} {
		if got := simnode.SocketProgramsOn(t, dir); got != want {
			t.Errorf("switched to shared: %d programs on %s, want %d", got, dir, want)
		}
	}
	if _, err := os.Stat(bpfobj.ZtunnelDir(n.BPFFSDir)); !os.IsNotExist(err) {
		t.Errorf("ztunnel's pins stay after the switch to shared hooks: %v", err)
	}
	d.Close()
	if _, err := New(perPodConfig(n)); err == nil || !strings.Contains(err.Error(), "per-pod socket hooks start on a node without enrolled pods") {
		t.Errorf("New with per-pod hooks over shared ones with a pod enrolled: %v", err)
	}
	if got := simnode.SocketProgramsOn(t, n.PodsCgroup); got != full {
		t.Errorf("the refused switch left %d programs on the pods cgroup, want %d", got, full)
	}
	if d, err = New(shared); err != nil {
		t.Fatal(err)
	}
}
