// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func newDataplane(t *testing.T, n *simnode.Node) *Dataplane {
	t.Helper()
	d, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	return d
}

func podOf(p *simnode.Pod) Pod {
	return Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs()}
}

// ingressPrograms counts the TC ingress programs on the pod's lo, where
// every pod has its return-path program (R10) on every kernel; inbound
// capture on eth0 is sk_lookup's where the kernel lets it.
func ingressPrograms(t *testing.T, p *simnode.Pod) int {
	t.Helper()
	n, err := pickTCHooks().count(p.NetnsPath(), "lo", ebpf.AttachTCXIngress)
	if err != nil {
		t.Fatalf("count tc programs: %v", err)
	}
	return n
}

func countEntries[K, V any](t *testing.T, m *ebpf.Map) int {
	t.Helper()
	var (
		k K
		v V
		n int
	)
	it := m.Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestEnrollIsIdempotent(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	ctx := context.Background()
	for range 3 {
		if err := d.Enroll(ctx, podOf(p)); err != nil {
			t.Fatalf("Enroll: %v", err)
		}
	}
	if got := d.List(); len(got) != 1 || got[0].UID != p.UID || len(got[0].IPs) != 2 {
		t.Fatalf("List = %+v, want one pod with two IPs", got)
	}
	if got := ingressPrograms(t, p); got != 1 {
		t.Errorf("%d ingress programs on lo, want 1", got)
	}
	if got := countEntries[bpfobj.SockAeAddr, bpfobj.SockPodInfo](t, d.sock.AePods); got != 2 {
		t.Errorf("ae_pods has %d entries, want 2", got)
	}

	// Enrolling with fewer IPs drops the stale entry; new options apply.
	pod := podOf(p)
	pod.IPs = []netip.Addr{p.V4}
	pod.Options.BypassInbound = true
	if err := d.Enroll(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if got := countEntries[bpfobj.SockAeAddr, bpfobj.SockPodInfo](t, d.sock.AePods); got != 1 {
		t.Errorf("after re-enroll with one IP, ae_pods has %d entries, want 1", got)
	}
	if got := d.List()[0].Options; !got.BypassInbound {
		t.Errorf("options not updated: %+v", got)
	}
}

func TestEnrollRefusesBadInputAndLeavesNothing(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	ctx := context.Background()
	cases := map[string]struct {
		mutate func(*Pod)
		want   string
	}{
		"no uid":            {func(q *Pod) { q.UID = "" }, "uid \"\""},
		"traversal uid":     {func(q *Pod) { q.UID = "../links" }, "uid \"../links\""},
		"dot uid":           {func(q *Pod) { q.UID = ".." }, "uid \"..\""},
		"NUL in uid":        {func(q *Pod) { q.UID = "a\x00b" }, "is not 1 to 63"},
		"overlong uid":      {func(q *Pod) { q.UID = strings.Repeat("a", 64) }, "is not 1 to 63"},
		"unicode uid":       {func(q *Pod) { q.UID = "pod-\u00e9" }, "is not 1 to 63"},
		"slash in reroute":  {func(q *Pod) { q.Options.RerouteInterfaces = []string{"../x"} }, "bad reroute interface"},
		"relative netns":    {func(q *Pod) { q.Netns = "run/netns/x" }, "not an absolute path"},
		"no IPs":            {func(q *Pod) { q.IPs = nil }, "no IPs"},
		"missing netns":     {func(q *Pod) { q.Netns = "/nonexistent/netns" }, "netns /nonexistent/netns"},
		"missing interface": {func(q *Pod) { q.Interface = "nope0" }, "find interface nope0"},
		// Fails after the first programs are attached: they, their pins
		// and the pod's pin directory go again.
		"missing reroute interface": {func(q *Pod) { q.Options.RerouteInterfaces = []string{"nope1"} }, "find interface nope1"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			pod := podOf(p)
			tc.mutate(&pod)
			err := d.Enroll(ctx, pod)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Enroll error = %v, want one mentioning %q", err, tc.want)
			}
			if !strings.Contains(err.Error(), p.Name) {
				t.Errorf("error %q does not name the pod", err)
			}
			if got := d.List(); len(got) != 0 {
				t.Errorf("List = %+v after a failed Enroll", got)
			}
			if got := ingressPrograms(t, p); got != 0 {
				t.Errorf("%d ingress programs left on lo", got)
			}
			if _, err := os.Stat(podDir(d.cfg, p.UID)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("pod pin directory left behind: %v", err)
			}
			if got := countEntries[uint64, bpfobj.SockNetnsInfo](t, d.sock.AeNetns); got != 0 {
				t.Errorf("ae_netns has %d entries after a failed Enroll", got)
			}
		})
	}
}

// A pod whose netns is the node's own (a CNI ADD or pod file can name
// any path) is refused, and the node's own TCP stays uncaptured. With the
// node's veth as the "pod" interface and another veth as its host side,
// every other check of Enroll passes.
func TestEnrollRefusesTheNodeNetns(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	out := n.StartOutsideApp()
	server := netip.AddrPortFrom(simnode.OutsideV4, 8080)
	out.Listen("tcp", "outside", server)
	kubelet := n.StartNodeApp()

	for _, netns := range []string{simnode.NetnsPath(n.NodeNS), fmt.Sprintf("/proc/%d/ns/net", kubelet.PID())} {
		pod := podOf(p)
		pod.Netns, pod.Interface, pod.HostInterface = netns, "out0", p.HostVeth
		err := d.Enroll(context.Background(), pod)
		if err == nil || !strings.Contains(err.Error(), "node's own network namespace") || !strings.Contains(err.Error(), p.Name) {
			t.Fatalf("Enroll of the node netns (%s): error %v, want a refusal naming the pod and the node's netns", netns, err)
		}
		if got := countEntries[uint64, bpfobj.SockNetnsInfo](t, d.sock.AeNetns); got != 0 {
			t.Fatalf("ae_netns has %d entries after the refusal", got)
		}
	}
	resp, err := kubelet.Dial("tcp", simnode.AppRequest{Addr: server})
	if err != nil {
		t.Fatalf("the node's own connection to %s: %v", server, err)
	}
	if resp.Reply.Server != "outside" || resp.Reply.Peer.Addr() != simnode.NodeV4 {
		t.Fatalf("the node's own connection reached %q from %s, want the outside server from %s", resp.Reply.Server, resp.Reply.Peer, simnode.NodeV4)
	}
}

func TestRemoveIsIdempotentAndCleans(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	ctx := context.Background()
	if err := d.Remove(ctx, "never-enrolled"); err != nil {
		t.Errorf("Remove of an unknown pod: %v", err)
	}
	if err := d.Enroll(ctx, podOf(p)); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := d.Remove(ctx, p.UID); err != nil {
			t.Fatalf("Remove: %v", err)
		}
	}
	if got := ingressPrograms(t, p); got != 0 {
		t.Errorf("%d ingress programs left on lo", got)
	}
	if got := countEntries[bpfobj.SockAeAddr, bpfobj.SockPodInfo](t, d.sock.AePods); got != 0 {
		t.Errorf("ae_pods has %d entries after Remove", got)
	}
	if _, err := os.Stat(podDir(d.cfg, p.UID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pod pins left behind: %v", err)
	}
}

// H4: a reused IP belongs to its newest pod; removing the old pod keeps
// it. The old pod is gone (its network deleted, its DEL missed): while it
// still has the address, the new one is refused (ErrDuplicateIP,
// TestDuplicateIPIsRefusedAndTheRunningPodStaysCaptured).
func TestIPReuseNeverRemovesTheNewOwner(t *testing.T) {
	n := simnode.New(t)
	old, cur := n.AddPod("old"), n.AddPod("new")
	d := newDataplane(t, n)
	ctx := context.Background()
	shared := old.V4
	oldPod := podOf(old)
	oldPod.IPs = []netip.Addr{shared}
	curPod := podOf(cur)
	curPod.IPs = []netip.Addr{shared}
	if err := d.Enroll(ctx, oldPod); err != nil {
		t.Fatal(err)
	}
	n.DeletePodNetwork(old)
	if err := d.Enroll(ctx, curPod); err != nil {
		t.Fatal(err)
	}
	// The stale owner went with the address's reuse, programs and all.
	if got := d.List(); len(got) != 1 || got[0].UID != cur.UID {
		t.Errorf("List = %+v, want the new owner alone", got)
	}
	if got := ingressPrograms(t, old); got != 0 {
		t.Errorf("%d programs left on the stale owner's lo", got)
	}
	if err := d.Remove(ctx, old.UID); err != nil {
		t.Fatal(err)
	}
	var info bpfobj.SockPodInfo
	if err := d.sock.AePods.Lookup(bpfobj.AddrKey(shared), &info); err != nil {
		t.Fatalf("entry for %s is gone after removing its previous owner: %v", shared, err)
	}
	if want := d.List()[0].NetnsCookie; info.NetnsCookie != want {
		t.Errorf("entry for %s belongs to netns %d, want the new pod's %d", shared, info.NetnsCookie, want)
	}
}

func TestRestartAdoptsPinnedState(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	ctx := context.Background()
	d1, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	pod := podOf(p)
	pod.Options.DNSCapture = true
	if err := d1.Enroll(ctx, pod); err != nil {
		t.Fatal(err)
	}
	before := d1.List()
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	// With the agent gone, the programs stay attached through their pins.
	if got := ingressPrograms(t, p); got != 1 {
		t.Fatalf("%d ingress programs while no agent runs, want 1", got)
	}

	d2 := newDataplane(t, n)
	after := d2.List()
	if len(after) != 1 || after[0].UID != before[0].UID || after[0].NetnsCookie != before[0].NetnsCookie ||
		!reflect.DeepEqual(after[0].Options, before[0].Options) || len(after[0].IPs) != 2 || after[0].Name != "a" {
		t.Fatalf("adopted %+v, enrolled %+v", after, before)
	}
	if got := ingressPrograms(t, p); got != 1 {
		t.Errorf("%d ingress programs after adoption, want 1 (updated in place)", got)
	}
	if err := d2.Enroll(ctx, pod); err != nil {
		t.Fatalf("re-enroll after adoption: %v", err)
	}
	if got := ingressPrograms(t, p); got != 1 {
		t.Errorf("%d ingress programs after re-enroll, want 1", got)
	}

	if err := d2.Uninstall(); err != nil {
		t.Fatalf("Uninstall: %v", err)
	}
	if got := ingressPrograms(t, p); got != 0 {
		t.Errorf("%d ingress programs after Uninstall", got)
	}
	if _, err := os.Stat(n.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pin directory %s left after Uninstall: %v", n.BPFFSDir, err)
	}
}

func TestPinnedViewReadsWithoutTheAgent(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	if _, err := inspect.OpenPinned(n.BPFFSDir); !errors.Is(err, inspect.ErrNotInstalled) {
		t.Fatalf("inspect.OpenPinned before install: %v, want inspect.ErrNotInstalled", err)
	}
	d := newDataplane(t, n)
	if err := d.Enroll(context.Background(), podOf(p)); err != nil {
		t.Fatal(err)
	}
	want := d.List()
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	view, err := inspect.OpenPinned(n.BPFFSDir)
	if err != nil {
		t.Fatalf("inspect.OpenPinned: %v", err)
	}
	defer view.Close()
	got, err := view.Pods()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].UID != want[0].UID || !reflect.DeepEqual(got[0].IPs, want[0].IPs) || got[0].HostInterface != p.HostVeth {
		t.Errorf("Pods() = %+v, want %+v", got, want)
	}
	dump, err := view.Dump()
	if err != nil {
		t.Fatal(err)
	}
	if len(dump.Pods) != 2 || dump.Pods[0].Pod != "default/a" || len(dump.Netns) != 1 || len(dump.Meta) != 1 {
		t.Errorf("Dump() = %+v", dump)
	}
	if dump.Netns[0].IPv4 != p.V4 || dump.Netns[0].IPv6 != p.V6 {
		t.Errorf("ae_netns decodes to %v/%v, want %v/%v", dump.Netns[0].IPv4, dump.Netns[0].IPv6, p.V4, p.V6)
	}
}

// The return path's sysctl is written through Config.ProcRoot (a second
// procfs mount, as in a container whose /proc/sys is read-only) and lands
// in the pod's netns only; removal restores it.
func TestFwmarkAcceptThroughAnotherProcMount(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	proc := t.TempDir()
	if err := unix.Mount("proc", proc, "proc", 0, ""); err != nil {
		t.Fatalf("mount proc: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(proc, unix.MNT_DETACH) })
	d, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), ProcRoot: proc})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	read := func(netns string) string {
		var v []byte
		if err := nsexec.Do(netns, func() error {
			var err error
			v, err = os.ReadFile("/proc/sys/net/ipv4/tcp_fwmark_accept")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(v))
	}
	nodeBefore := read(simnode.NetnsPath(n.NodeNS))
	if err := d.Enroll(context.Background(), podOf(p)); err != nil {
		t.Fatal(err)
	}
	if got := read(p.NetnsPath()); got != "1" {
		t.Errorf("pod tcp_fwmark_accept = %s while enrolled, want 1", got)
	}
	if got := read(simnode.NetnsPath(n.NodeNS)); got != nodeBefore {
		t.Errorf("node tcp_fwmark_accept changed to %s", got)
	}
	if err := d.Remove(context.Background(), p.UID); err != nil {
		t.Fatal(err)
	}
	if got := read(p.NetnsPath()); got != "0" {
		t.Errorf("pod tcp_fwmark_accept = %s after removal, want 0", got)
	}
}

// A cgroup root that is no cgroup v2 directory is refused before the
// kernel is touched: nothing is pinned.
func TestNewRefusesNonCgroup2RootAndLeavesNothing(t *testing.T) {
	n := simnode.New(t)
	_, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: t.TempDir(), NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err == nil || !strings.Contains(err.Error(), "not a cgroup v2 directory") {
		t.Fatalf("New error = %v, want a refusal naming the cgroup root", err)
	}
	if _, err := os.Stat(n.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after a refused start: %v", err)
	}
}

// Pins made for one cgroup root are not silently kept while another is
// configured: the start is refused and the running data path is left as
// it is.
func TestNewRefusesAChangedCgroupRoot(t *testing.T) {
	n := simnode.New(t)
	d1, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(n.CgroupRoot, "other")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	_, err = New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: other, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err == nil || !strings.Contains(err.Error(), "cgroup root changed") {
		t.Fatalf("New with another cgroup root: %v, want a refusal", err)
	}
	for _, h := range []string{"connect4", "sockops"} {
		if _, err := os.Stat(filepath.Join(n.BPFFSDir, "links", h)); err != nil {
			t.Errorf("pinned %s hook of the running data path: %v", h, err)
		}
	}
	// The original root still works, and takes the pins back.
	newDataplane(t, n)
}

// A socket load balancer attached the old way (BPF_PROG_ATTACH without
// BPF_F_ALLOW_MULTI, as older Cilium releases do) holds its hook alone:
// the start is refused with an error naming the program, the hook and
// what to do, and nothing is left pinned. Once it is gone, the start works.
func TestNewNamesAProgramThatHoldsAHookAlone(t *testing.T) {
	n := simnode.New(t)
	detach := n.AttachExclusive(ebpf.AttachCGroupInet4Connect, "lb_sock4_conn")
	_, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	for _, want := range []string{"attach connect4 to cgroup " + n.CgroupRoot, "program lb_sock4_conn (id ", "holds connect4 of cgroup " + n.CgroupRoot + " exclusively", "BPF_F_ALLOW_MULTI"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("New beside an exclusive program: %v, want an error with %q", err, want)
		}
	}
	if _, err := os.Stat(n.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after a refused start: %v", err)
	}
	detach()
	newDataplane(t, n)
}
