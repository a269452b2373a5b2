// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"errors"
	"net"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Programs other software (a primary CNI) puts on the interfaces the data
// path uses, ahead of ours.

// AttachTCX attaches prog to iface in the named netns as a TCX link, which
// runs before every classic filter; the link goes at cleanup.
func (n *Node) AttachTCX(ns, iface string, attach ebpf.AttachType, prog *ebpf.Program) {
	n.t.Helper()
	if err := InNetns(ns, func() error {
		ifc, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		l, err := link.AttachTCX(link.TCXOptions{Interface: ifc.Index, Program: prog, Attach: attach})
		if err == nil {
			n.t.Cleanup(func() { l.Close() })
		}
		return err
	}); err != nil {
		n.t.Fatalf("attach tcx program to %s in %s: %v", iface, ns, err)
	}
}

// AddTCFilter adds prog to iface in the named netns as a direct-action
// classic filter at priority 1, handle 1 (ahead of ours), creating the
// clsact qdisc when missing; it goes with the interface.
func (n *Node) AddTCFilter(ns, iface string, attach ebpf.AttachType, prog *ebpf.Program, name string) {
	n.t.Helper()
	parent := uint32(netlink.HANDLE_MIN_INGRESS)
	if attach == ebpf.AttachTCXEgress {
		parent = netlink.HANDLE_MIN_EGRESS
	}
	if err := InNetns(ns, func() error {
		ifc, err := net.InterfaceByName(iface)
		if err != nil {
			return err
		}
		q := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifc.Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
			QdiscType:  "clsact",
		}
		if err := netlink.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		return netlink.FilterAdd(&netlink.BpfFilter{
			FilterAttrs:  netlink.FilterAttrs{LinkIndex: ifc.Index, Parent: parent, Handle: 1, Priority: 1, Protocol: unix.ETH_P_ALL},
			Fd:           prog.FD(),
			Name:         name,
			DirectAction: true,
		})
	}); err != nil {
		n.t.Fatalf("add tc filter to %s in %s: %v", iface, ns, err)
	}
}
