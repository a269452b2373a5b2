// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

const dupPort = 7019

// dupNode is a node with pod c enrolled-to-be (its app listening on
// dupPort, ztunnel serving it) and another pod, d, of its own addresses.
type dupNode struct {
	n    *simnode.Node
	c, d *simnode.Pod
	zt   *simnode.Ztunnel
	out  *simnode.App
}

func newDupNode(t *testing.T) *dupNode {
	n := simnode.New(t)
	e := &dupNode{n: n, c: n.AddPod("dupc"), d: n.AddPod("dupd")}
	e.zt = n.StartZtunnel()
	e.zt.Add(e.c)
	n.StartApp(e.c).Listen("tcp", "c", netip.AddrPortFrom(netip.IPv6Unspecified(), dupPort))
	e.out = n.StartOutsideApp()
	return e
}

// running is p as a running pod: ztunnel's listeners in it, opened
// before the data path's hooks were attached, are filed by Enroll.
func (e *dupNode) running(p *simnode.Pod) Pod {
	pod := podOf(p)
	pod.Running = true
	return pod
}

// inboundCaptured reports an error for each of c's addresses that an
// inbound connection from the outside host reaches past ztunnel's :15006.
func (e *dupNode) inboundCaptured(t *testing.T, when string) {
	t.Helper()
	for _, ip := range e.c.IPs() {
		dst := netip.AddrPortFrom(ip, dupPort)
		resp, err := e.out.Dial("tcp", simnode.AppRequest{Addr: dst})
		if err != nil {
			t.Errorf("%s: connect to pod c at %s: %v", when, dst, err)
			continue
		}
		if r, ok := e.zt.RecordSince(resp.Local, resp.Start); !ok || r.Listener != standin.InboundPort || r.OrigDst != dst {
			t.Errorf("%s: the inbound connection to pod c at %s reached %s without ztunnel's :%d (record %+v, %v)",
				when, dst, resp.Reply.Server, standin.InboundPort, r, ok)
		}
	}
}

// A pod enrolled with an address another running pod has (an IPAM fault,
// a static IP, a forged prevResult) is refused, naming both pods and the
// address, and leaves nothing behind; its removal (the CNI DEL after the
// failed ADD) leaves the running pod's entries: that pod's inbound
// connections still reach ztunnel, on both families. Before, the
// newcomer took the entry and its removal deleted it, and the running
// pod's inbound traffic reached its app past ztunnel for good.
func TestDuplicateIPIsRefusedAndTheRunningPodStaysCaptured(t *testing.T) {
	e := newDupNode(t)
	d := newDataplane(t, e.n)
	ctx := context.Background()
	if err := d.Enroll(ctx, e.running(e.c)); err != nil {
		t.Fatal(err)
	}
	e.inboundCaptured(t, "before")

	dup := podOf(e.d)
	dup.IPs = append(dup.IPs, e.c.V4, e.c.V6)
	err := d.Enroll(ctx, dup)
	if !errors.Is(err, ErrDuplicateIP) {
		t.Errorf("Enroll of pod d with pod c's addresses: %v, want ErrDuplicateIP", err)
	} else {
		for _, s := range []string{e.c.Name, e.d.Name, e.c.UID, e.d.UID, e.c.V4.String()} {
			if !strings.Contains(err.Error(), s) {
				t.Errorf("the refusal %q does not name %s", err, s)
			}
		}
		if got := ingressPrograms(t, e.d); got != 0 {
			t.Errorf("%d programs left on the refused pod's lo", got)
		}
		if _, err := os.Stat(podDir(d.cfg, e.d.UID)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the refused pod's pin directory is there: %v", err)
		}
	}
	if err := d.Remove(ctx, e.d.UID); err != nil {
		t.Fatal(err)
	}
	e.inboundCaptured(t, "after pod d's ADD and DEL")
	if got := d.List(); len(got) != 1 || got[0].UID != e.c.UID || len(got[0].IPs) != 2 || got[0].Problem != "" {
		t.Errorf("List = %+v, want pod c alone, with both addresses and no problem", got)
	}
	view, err := inspect.OpenPinned(e.n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	if got, err := view.Pods(); err != nil || len(got) != 1 || len(got[0].IPs) != 2 || got[0].Problem != "" {
		t.Errorf("pinned Pods = %+v, %v, want pod c alone, with both addresses and no problem", got, err)
	}
}

// A pinned state an agent before the refusal left (pod c's ae_pods
// entries gone, or another pod's) is shown as such, with c's addresses,
// and a restarted agent restores c's entries: its inbound connections
// reach ztunnel again.
func TestRestartRestoresTheEntriesADuplicateTook(t *testing.T) {
	e := newDupNode(t)
	ctx := context.Background()
	d1, err := New(Config{BPFFSDir: e.n.BPFFSDir, CgroupRoot: e.n.CgroupRoot, NodeNetns: simnode.NetnsPath(e.n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*simnode.Pod{e.c, e.d} {
		if err := d1.Enroll(ctx, e.running(p)); err != nil {
			t.Fatal(err)
		}
	}
	// What an older agent left: c's IPv4 entry is d's (d enrolled with it
	// last), c's IPv6 entry went with another duplicate's removal.
	var dInfo bpfobj.SockPodInfo
	if err := d1.sock.AePods.Lookup(bpfobj.AddrKey(e.d.V4), &dInfo); err != nil {
		t.Fatal(err)
	}
	if err := d1.sock.AePods.Put(bpfobj.AddrKey(e.c.V4), &dInfo); err != nil {
		t.Fatal(err)
	}
	if err := d1.sock.AePods.Delete(bpfobj.AddrKey(e.c.V6)); err != nil {
		t.Fatal(err)
	}
	view, err := inspect.OpenPinned(e.n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	pods, err := view.Pods()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if p.UID != e.c.UID {
			continue
		}
		if len(p.IPs) != 2 || !strings.Contains(p.Problem, "the ae_pods entry for "+e.c.V4.String()+" is pod default/"+e.d.Name+"'s") ||
			!strings.Contains(p.Problem, "no ae_pods entry for "+e.c.V6.String()) {
			t.Errorf("pinned view of pod c: %+v, want both addresses and a problem naming each", p)
		}
	}
	// why answers as the programs do: the lost addresses are not captured.
	for _, ip := range e.c.IPs() {
		from := simnode.OutsideV4
		if ip.Is6() {
			from = simnode.OutsideV6
		}
		a, err := view.Why(inspect.Query{FromAddr: from, To: netip.AddrPortFrom(ip, dupPort)})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range a.Legs {
			if l.To.Port() == standin.InboundPort {
				t.Errorf("why says the connection to %s is captured (%s), which its lost entry does not do", ip, a.Summary)
			}
		}
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}

	d2 := newDataplane(t, e.n)
	for _, p := range d2.List() {
		if p.Problem != "" || len(p.IPs) != 2 {
			t.Errorf("after the restart, pod %s: %+v, want two addresses and no problem", p.Name, p)
		}
	}
	e.inboundCaptured(t, "after the restart")
}
