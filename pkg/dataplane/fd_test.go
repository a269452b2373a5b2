// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The agent holds no descriptor per enrolled pod: every per-pod program
// and link lives on in its pin (and a tc filter in the kernel), so a node
// of 8192 pods needs no more descriptors than one of one pod. Enrolling
// pods, and adopting them after a restart, leaves the process's open
// descriptors as they were.
func TestEnrolledPodsHoldNoDescriptors(t *testing.T) {
	// Any descriptor held per pod shows with two pods as with 32 (the
	// counts are compared exactly); 8 keep the test quick under
	// emulation, where each pod's netns and veth take a second.
	const pods = 8
	n := simnode.New(t)
	var all []*simnode.Pod
	for i := range pods {
		all = append(all, n.AddPod(fmt.Sprintf("fd%d", i)))
	}
	ctx := context.Background()
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}

	beforeNew := nstest.CountFDs(t)
	d1, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	loaded := nstest.CountFDs(t) - beforeNew // the node's objects and links
	// The first enrolment opens whatever the process opens once (the
	// runtime's, netlink's); only what comes after is per pod.
	if err := d1.Enroll(ctx, podOf(all[0])); err != nil {
		t.Fatal(err)
	}
	before := nstest.OpenFDs(t)
	for _, p := range all[1:] {
		if err := d1.Enroll(ctx, podOf(p)); err != nil {
			t.Fatal(err)
		}
	}
	if len(d1.List()) != pods {
		t.Fatalf("%d pods enrolled, want %d", len(d1.List()), pods)
	}
	// Enrolling pods again (nothing new to attach) keeps none either.
	for _, p := range all {
		if err := d1.Enroll(ctx, podOf(p)); err != nil {
			t.Fatal(err)
		}
	}
	nstest.SameFDs(t, before)
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	// A restarted agent adopts every pod (each pinned program moved to
	// the new one in place) and holds as many descriptors as one that
	// started with none.
	beforeNew = nstest.CountFDs(t)
	d2 := newDataplane(t, n)
	if got := len(d2.List()); got != pods {
		t.Fatalf("%d pods adopted, want %d", got, pods)
	}
	if got := nstest.CountFDs(t) - beforeNew; got != loaded {
		t.Errorf("New adopting %d pods opened %d descriptors, New with none %d: the pods hold %d", pods, got, loaded, got-loaded)
	}
	// The pins alone hold the programs, and removal takes them out
	// through the pins.
	before = nstest.OpenFDs(t)
	for _, p := range all {
		if lo, sk := ingressPrograms(t, p), skLookupPrograms(t, p); lo != 1 || sk != 1 {
			t.Errorf("pod %s: %d programs on lo and %d sk_lookup programs while adopted, want 1 and 1", p.Name, lo, sk)
		}
		if err := d2.Remove(ctx, p.UID); err != nil {
			t.Fatal(err)
		}
		if lo, sk := ingressPrograms(t, p), skLookupPrograms(t, p); lo != 0 || sk != 0 {
			t.Errorf("pod %s: %d programs on lo and %d sk_lookup programs after Remove", p.Name, lo, sk)
		}
	}
	nstest.SameFDs(t, before)
}

// A pod whose sandbox is made again (the same UID in a new netns) keeps
// its old programs until the new enrolment is done. The agent holds no
// descriptor for them, so when the enrolment fails, it pins them again:
// the old sk_lookup link would die with its pin, and a restarted agent
// would not find the others (to update or remove them) without theirs.
func TestFailedMoveToANewNetnsKeepsTheOldPins(t *testing.T) {
	n := simnode.New(t)
	a, b := n.AddPod("a"), n.AddPod("b")
	// The SNAT host-probe mode: the last programs attached are on the
	// node side, where the enrolment fails.
	d, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), HostProbes: bpfobj.ProbeSNAT})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	ctx := context.Background()
	if err := d.Enroll(ctx, podOf(a)); err != nil {
		t.Fatal(err)
	}
	pins := func() []string {
		paths, err := filepath.Glob(filepath.Join(podDir(d.cfg, a.UID), "*"))
		if err != nil {
			t.Fatal(err)
		}
		return paths
	}
	before := pins()
	moved := podOf(b)
	moved.UID, moved.Name = a.UID, a.Name
	// Fails on the node side, after the new netns's programs took the
	// pins of the pod's lo and its sk_lookup link.
	moved.HostInterface = "nope2"
	if err := d.Enroll(ctx, moved); err == nil || !strings.Contains(err.Error(), "find interface nope2") {
		t.Fatalf("Enroll into the new netns: %v, want a failure on the host interface", err)
	}
	if got := pins(); !slices.Equal(got, before) {
		t.Errorf("pins after the failed enrolment: %v, want %v", got, before)
	}
	check := func(when string, p *simnode.Pod, want int) {
		t.Helper()
		if lo, sk := ingressPrograms(t, p), skLookupPrograms(t, p); lo != want || sk != want {
			t.Errorf("%s: pod %s has %d programs on lo and %d sk_lookup programs, want %d", when, p.Name, lo, sk, want)
		}
	}
	check("after the failed enrolment", a, 1)
	check("after the failed enrolment", b, 0)
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	check("with no agent", a, 1)
	d = newDataplane(t, n)
	if got := d.List(); len(got) != 1 || got[0].UID != a.UID {
		t.Fatalf("adopted %+v, want the pod in its old netns", got)
	}
	check("adopted", a, 1)
	if err := d.Remove(ctx, a.UID); err != nil {
		t.Fatal(err)
	}
	check("removed", a, 0)
}

// Running out of descriptors fails an enrolment with an error that names
// the pod and the limit, and leaves nothing of it behind.
func TestEnrollOutOfDescriptorsNamesTheLimit(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	var orig unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	// Room for none: the limit is the lowest free descriptor.
	free, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = unix.Close(free)
	squeezed := unix.Rlimit{Cur: uint64(free), Max: orig.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &squeezed); err != nil {
		t.Fatal(err)
	}
	err = d.Enroll(context.Background(), podOf(p))
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(err, unix.EMFILE) || !strings.Contains(err.Error(), fmt.Sprintf("RLIMIT_NOFILE, of %d", squeezed.Cur)) || !strings.Contains(err.Error(), p.Name) {
		t.Fatalf("Enroll with no descriptor left: %v, want an error naming the pod and the limit", err)
	}
	t.Logf("Enroll with no descriptor left: %v", err)
	checkUntouched(t, d, p)
}
