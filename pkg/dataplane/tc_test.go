// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The classic tc path (kernels before 6.6) on whatever kernel runs the
// test: our filter is added next to someone else's, replaced in place on
// adoption, and its removal leaves the other filter and the qdisc alone.
func TestClassicTCTouchesOnlyItsOwnFilter(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	d := newDataplane(t, n)
	a := attachment{pin: "ingress", netns: p.NetnsPath(), iface: "eth0", attach: ebpf.AttachTCXIngress, prog: d.tc.AePodIngress}
	other := attachment{pin: "other", netns: p.NetnsPath(), iface: "eth0", attach: ebpf.AttachTCXIngress}
	// Someone else's clsact qdisc and filter come first.
	if err := other.setFilterAt(d.tc.AePodLoIngress, 1); err != nil {
		t.Fatalf("add the other filter: %v", err)
	}
	pin := filepath.Join(podsDir(d.cfg), "ingress-test")
	hooks := classicHooks{}
	f, err := hooks.attach(a, pin)
	if err != nil {
		t.Fatalf("attach: %v", err)
	}
	if got := filterNames(t, a); len(got) != 2 || got[0] != "ae_other" || got[1] != "ae_ingress" {
		t.Fatalf("filters after attach = %v, want the other one, then ours", got)
	}
	before := filterProgIDs(t, a)
	// A restarted agent brings freshly loaded programs.
	next := a
	next.prog = d.tc.AePodReroute
	f, err = hooks.adopt(next, pin)
	if err != nil {
		t.Fatalf("adopt: %v", err)
	}
	if got := filterNames(t, a); len(got) != 2 {
		t.Fatalf("filters after adopt = %v, want two", got)
	}
	if after := filterProgIDs(t, a); after[1] == before[1] || after[0] != before[0] {
		t.Errorf("program ids %v -> %v: adoption must replace ours, only", before, after)
	}
	if err := f.detach(); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if got := filterNames(t, a); len(got) != 1 || got[0] != "ae_other" {
		t.Errorf("filters after detach = %v, want only the other one", got)
	}
	err = nsexec.Do(p.NetnsPath(), func() error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		qdiscs, err := netlink.QdiscList(l)
		for _, q := range qdiscs {
			if q.Type() == "clsact" {
				return err
			}
		}
		t.Errorf("the clsact qdisc is gone: %v", qdiscs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// Someone else's filter at our priority and handle is never replaced.
	squatter := attachment{pin: "squatter", netns: p.NetnsPath(), iface: "eth0", attach: ebpf.AttachTCXIngress}
	if err := squatter.setFilterAt(d.tc.AePodLoIngress, bpfobj.TCFilterPriority); err != nil {
		t.Fatalf("add a filter at our priority: %v", err)
	}
	if _, err := hooks.attach(a, pin); err == nil {
		t.Errorf("attach replaced a foreign filter at priority %#x handle %#x", bpfobj.TCFilterPriority, bpfobj.TCFilterHandle)
	}
	if got := filterNames(t, a); len(got) != 2 || got[1] != "ae_squatter" {
		t.Errorf("filters = %v, want the other one and the squatter", got)
	}
}

// setFilterAt adds a's filter at priority prio, as other software would.
func (a attachment) setFilterAt(prog *ebpf.Program, prio uint16) error {
	return attachedTo(a, func(ifindex int) error {
		q := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
			QdiscType:  "clsact",
		}
		if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		f := a.filter(ifindex, prog)
		f.Priority = prio
		return netlink.FilterAdd(f)
	})
}

func (a attachment) list(t *testing.T) []*netlink.BpfFilter {
	t.Helper()
	var out []*netlink.BpfFilter
	err := attachedTo(a, func(ifindex int) error {
		var err error
		out, err = listFilters(ifindex, bpfobj.TCParent(a.attach))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func filterNames(t *testing.T, a attachment) []string {
	var names []string
	for _, f := range a.list(t) {
		names = append(names, f.Name)
	}
	return names
}

func filterProgIDs(t *testing.T, a attachment) []int {
	var ids []int
	for _, f := range a.list(t) {
		ids = append(ids, f.Id)
	}
	return ids
}
