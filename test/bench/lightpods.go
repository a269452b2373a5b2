// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// lightPods makes pods the cheap way, for the scale and enrollment runs: a
// named netns with lo up and eth0 (dual-stack, /32 and /128), a veth to the
// node with the node's routes to it, and no app. It uses netlink in
// process, because simnode.AddPod's `ip` commands would take minutes for a
// thousand pods. Names follow simnode's scheme, so the node's leftover
// check covers them; everything is removed at cleanup, or by remove.
type lightPods struct {
	t     testing.TB
	node  *simnode.Node
	nh    *netlink.Handle // in the node netns
	next  int
	pause map[string]*simnode.Pause // by pod UID
	// pidns, when set, is the PID (the test's numbering) of the init of
	// the node's PID namespace, where pause processes then run.
	pidns int
}

// firstLightIndex keeps light pods' indices, names and addresses clear of
// simnode's pods (which count up from 10).
const firstLightIndex = 10000

func newLightPods(t testing.TB, n *simnode.Node) *lightPods {
	t.Helper()
	ns, err := netns.GetFromPath(simnode.NetnsPath(n.NodeNS))
	if err != nil {
		t.Fatalf("open node netns: %v", err)
	}
	defer ns.Close()
	nh, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatalf("netlink in node netns: %v", err)
	}
	lp := &lightPods{t: t, node: n, nh: nh, next: firstLightIndex, pause: map[string]*simnode.Pause{}}
	t.Cleanup(nh.Close)
	return lp
}

// add makes count pods named prefix<i>.
func (lp *lightPods) add(prefix string, count int) ([]*simnode.Pod, error) {
	pods := lp.plan(prefix, count)
	return pods, lp.create(pods, false)
}

// plan names count pods prefix<i> and gives them addresses, UIDs and veth
// names, making nothing yet: the agent's pod file can name pods before
// they exist, as the API server knows pods before their sandboxes.
func (lp *lightPods) plan(prefix string, count int) []*simnode.Pod {
	pods := make([]*simnode.Pod, 0, count)
	for i := range count {
		idx := lp.next
		lp.next++
		off := idx - firstLightIndex + 1
		name := fmt.Sprintf("%s%d", prefix, i)
		pods = append(pods, &simnode.Pod{
			Name: name, Namespace: "scale", UID: fmt.Sprintf("%s-0000-4000-8000-%012d", lp.node.ID, idx),
			NS:       "ae" + lp.node.ID + "-" + name,
			V4:       netip.AddrFrom4([4]byte{198, 18, byte(64 + off>>8), byte(off)}),
			V6:       netip.MustParseAddr(fmt.Sprintf("fd00:198:18:2::%x", off)),
			HostVeth: fmt.Sprintf("veth%s%d", lp.node.ID[:4], idx),
		})
	}
	return pods
}

// create makes planned pods. With pause, each pod also gets a cgroup
// pod<uid> below the node's pods cgroup and a pause process
// (simnode.StartPause, in the PID namespace pidns when set): what an
// agent finds when it looks for pods' netns in /proc.
func (lp *lightPods) create(pods []*simnode.Pod, pause bool) error {
	for _, p := range pods {
		if err := lp.createOne(p); err != nil {
			return err
		}
		if pause {
			lp.pause[p.UID] = lp.node.StartPause(p, lp.pidns)
		}
	}
	return nil
}

// remove takes pods away again: their pause process, netns (and with it
// the veth pair) and cgroup.
func (lp *lightPods) remove(pods []*simnode.Pod) error {
	var errs []error
	for _, p := range pods {
		if ps := lp.pause[p.UID]; ps != nil {
			if err := ps.Stop(); err != nil {
				errs = append(errs, fmt.Errorf("pause process of %s: %w", p.Name, err))
			}
			delete(lp.pause, p.UID)
		}
		if err := netns.DeleteNamed(p.NS); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("delete netns %s: %w", p.NS, err))
		}
		if p.Cgroup != "" {
			if err := simnode.RemoveCgroup(p.Cgroup); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (lp *lightPods) createOne(p *simnode.Pod) error {
	podNS, err := newNamedNetns(p.NS)
	if err != nil {
		return err
	}
	lp.t.Cleanup(func() {
		if err := netns.DeleteNamed(p.NS); err != nil && !errors.Is(err, os.ErrNotExist) {
			lp.t.Errorf("delete netns %s: %v", p.NS, err)
		}
	})
	defer podNS.Close()
	ph, err := netlink.NewHandleAt(podNS)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", p.NS, err)
	}
	defer ph.Close()

	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: p.HostVeth}, PeerName: "eth0", PeerNamespace: netlink.NsFd(podNS)}
	if err := lp.nh.LinkAdd(veth); err != nil {
		return fmt.Errorf("add veth %s: %w", p.HostVeth, err)
	}
	lp.t.Cleanup(func() {
		// Deleting the pod's netns removes the pair; the explicit delete
		// only makes it prompt.
		if l, err := lp.nh.LinkByName(p.HostVeth); err == nil {
			_ = lp.nh.LinkDel(l)
		}
	})
	host, err := lp.nh.LinkByName(p.HostVeth)
	if err != nil {
		return fmt.Errorf("find %s: %w", p.HostVeth, err)
	}
	for _, a := range []netip.Addr{simnode.GatewayV4, simnode.GatewayV6} {
		if err := lp.nh.AddrAdd(host, hostAddr(a)); err != nil {
			return fmt.Errorf("address %s on %s: %w", a, p.HostVeth, err)
		}
	}
	if err := lp.nh.LinkSetUp(host); err != nil {
		return fmt.Errorf("up %s: %w", p.HostVeth, err)
	}
	for _, a := range p.IPs() {
		if err := lp.nh.RouteAdd(&netlink.Route{LinkIndex: host.Attrs().Index, Dst: prefixNet(a), Scope: netlink.SCOPE_LINK}); err != nil {
			return fmt.Errorf("route to %s: %w", a, err)
		}
	}

	for _, ifname := range []string{"lo", "eth0"} {
		l, err := ph.LinkByName(ifname)
		if err != nil {
			return fmt.Errorf("find %s in %s: %w", ifname, p.NS, err)
		}
		if ifname == "eth0" {
			for _, a := range p.IPs() {
				if err := ph.AddrAdd(l, hostAddr(a)); err != nil {
					return fmt.Errorf("address %s in %s: %w", a, p.NS, err)
				}
			}
		}
		if err := ph.LinkSetUp(l); err != nil {
			return fmt.Errorf("up %s in %s: %w", ifname, p.NS, err)
		}
	}
	return nil
}

// hostAddr is a /32 or /128 address without duplicate address detection.
func hostAddr(a netip.Addr) *netlink.Addr {
	return &netlink.Addr{IPNet: prefixNet(a), Flags: unix.IFA_F_NODAD}
}

func prefixNet(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
}

// newNamedNetns creates /run/netns/name on a thread of its own, which
// then dies with its goroutine, so no thread is left in the new netns.
func newNamedNetns(name string) (netns.NsHandle, error) {
	type result struct {
		h   netns.NsHandle
		err error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with the goroutine
		h, err := netns.NewNamed(name)
		if err != nil {
			err = fmt.Errorf("create netns %s: %w", name, err)
		}
		ch <- result{h, err}
	}()
	r := <-ch
	return r.h, r.err
}
