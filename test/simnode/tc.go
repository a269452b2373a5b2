// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
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

// DropRepliesTo emulates a primary CNI whose program takes a pod's packets
// on the node side of its veth ahead of ours and forwards them by the FIB,
// where the destinations given have no route: Cilium's BPF host routing
// and BPF masquerade drop a pod's replies to 169.254.7.127 this way
// (istio/istio#52208), and AWS's branch-ENI routing sends them out of the
// wrong interface. A BPF filter at priority 1 of the veth's ingress drops
// them before any later program runs; the rest goes on. It goes with the
// interface. IPv4 prefixes and IPv6 prefixes of up to /64.
func (n *Node) DropRepliesTo(p *Pod, prefixes ...netip.Prefix) {
	n.t.Helper()
	prog, err := dropProgram(prefixes)
	if err != nil {
		n.t.Fatalf("drop replies to %v: %v", prefixes, err)
	}
	n.t.Cleanup(func() { prog.Close() })
	n.AddTCFilter(n.NodeNS, p.HostVeth, ebpf.AttachTCXIngress, prog, "drop_link_local")
}

// dropProgram is a classic tc program that drops IP packets to the
// prefixes and lets everything else go on to the next filter.
func dropProgram(prefixes []netip.Prefix) (*ebpf.Program, error) {
	const scratch = -8 // stack slot bpf_skb_load_bytes copies into
	load := func(off, size int32, fail string) asm.Instructions {
		return asm.Instructions{
			asm.Mov.Reg(asm.R1, asm.R6), asm.Mov.Imm(asm.R2, off), asm.Mov.Reg(asm.R3, asm.RFP), asm.Add.Imm(asm.R3, scratch), asm.Mov.Imm(asm.R4, size),
			asm.FnSkbLoadBytes.Call(),
			asm.JNE.Imm(asm.R0, 0, fail),
		}
	}
	insns := asm.Instructions{asm.Mov.Reg(asm.R6, asm.R1)}
	insns = append(insns, load(12, 2, "pass")...) // the ethertype
	insns = append(insns, asm.LoadMem(asm.R7, asm.RFP, scratch, asm.Half), asm.HostTo(asm.BE, asm.R7, asm.Half))
	for i, pfx := range prefixes {
		next := fmt.Sprintf("next%d", i)
		proto, off := int32(0x0800), int32(14+16)
		if pfx.Addr().Is6() {
			proto, off = 0x86dd, 14+24
		}
		if pfx.Addr().Is6() && pfx.Bits() > 64 {
			return nil, fmt.Errorf("prefix %s: at most /64", pfx)
		}
		insns = append(insns, asm.JNE.Imm(asm.R7, proto, next))
		for j, key := range destinationKeys(pfx) {
			insns = append(insns, load(off+4*int32(j), 4, next)...)
			insns = append(insns,
				asm.LoadMem(asm.R1, asm.RFP, scratch, asm.Word), asm.HostTo(asm.BE, asm.R1, asm.Word),
				asm.And.Imm32(asm.R1, int32(key.mask)), asm.JNE.Imm32(asm.R1, int32(key.val), next))
		}
		insns = append(insns, asm.Mov.Imm(asm.R0, 2), asm.Return()) // TC_ACT_SHOT
		insns = append(insns, asm.Mov.Imm(asm.R0, 0).WithSymbol(next))
	}
	insns = append(insns, asm.Mov.Imm(asm.R0, -1).WithSymbol("pass"), asm.Return()) // TC_ACT_UNSPEC: next filter
	return ebpf.NewProgram(&ebpf.ProgramSpec{Name: "drop_link_local", Type: ebpf.SchedCLS, License: "Dual BSD/GPL", Instructions: insns})
}

type destinationKey struct{ mask, val uint32 }

// destinationKeys are the 32-bit words of a prefix, masked, in order.
func destinationKeys(pfx netip.Prefix) []destinationKey {
	pfx = pfx.Masked()
	addr := pfx.Addr().AsSlice()
	var keys []destinationKey
	for i, bits := 0, pfx.Bits(); bits > 0; i, bits = i+4, bits-32 {
		mask := ^uint32(0)
		if bits < 32 {
			mask <<= 32 - bits
		}
		keys = append(keys, destinationKey{mask: mask, val: binary.BigEndian.Uint32(addr[i:]) & mask})
	}
	return keys
}

// AttachExclusive attaches a pass-through program named name to one of
// the node cgroup's socket hooks the old way, BPF_PROG_ATTACH without
// BPF_F_ALLOW_MULTI (older Cilium releases attach their socket load
// balancer so): no other program can attach there while it is. The
// returned func detaches it; cleanup does too.
func (n *Node) AttachExclusive(attach ebpf.AttachType, name string) (detach func()) {
	n.t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: name, Type: ebpf.CGroupSockAddr, AttachType: attach, License: "Dual BSD/GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	})
	if err != nil {
		n.t.Fatalf("load %s: %v", name, err)
	}
	cg, err := os.Open(n.CgroupRoot)
	if err != nil {
		prog.Close()
		n.t.Fatal(err)
	}
	opts := link.RawAttachProgramOptions{Target: int(cg.Fd()), Program: prog, Attach: attach}
	if err := link.RawAttachProgram(opts); err != nil {
		cg.Close()
		prog.Close()
		n.t.Fatalf("attach %s to %s: %v", name, n.CgroupRoot, err)
	}
	var once sync.Once
	detach = func() {
		once.Do(func() {
			if err := link.RawDetachProgram(link.RawDetachProgramOptions{Target: opts.Target, Program: prog, Attach: attach}); err != nil {
				n.t.Errorf("detach %s: %v", name, err)
			}
			cg.Close()
			prog.Close()
		})
	}
	n.t.Cleanup(detach)
	return detach
}

// AttachSocketLB attaches a socket load balancer to the node's cgroup
// root, as Cilium's kube-proxy replacement does: connect4 turns vip into
// backend, getpeername4 turns backend back into vip (for every socket, as a
// test's stand-in for the connection tracking a real one keeps). Shared
// hooks (BPF_F_ALLOW_MULTI), so it runs where its attach order puts it;
// the links go at cleanup.
func (n *Node) AttachSocketLB(vip, backend netip.AddrPort) {
	n.t.Helper()
	translate := func(name string, attach ebpf.AttachType, from, to netip.AddrPort) {
		const userIP4, userPort = 4, 24 // offsets in struct bpf_sock_addr
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Name: name, Type: ebpf.CGroupSockAddr, AttachType: attach, License: "Dual BSD/GPL",
			Instructions: asm.Instructions{
				asm.Mov.Reg(asm.R6, asm.R1),
				asm.LoadMem(asm.R2, asm.R6, userIP4, asm.Word),
				asm.JNE.Imm32(asm.R2, wireIP4(from.Addr()), "out"),
				asm.LoadMem(asm.R2, asm.R6, userPort, asm.Word),
				asm.JNE.Imm32(asm.R2, wirePort(from.Port()), "out"),
				asm.Mov.Imm32(asm.R2, wireIP4(to.Addr())),
				asm.StoreMem(asm.R6, userIP4, asm.R2, asm.Word),
				asm.Mov.Imm32(asm.R2, wirePort(to.Port())),
				asm.StoreMem(asm.R6, userPort, asm.R2, asm.Word),
				asm.Mov.Imm(asm.R0, 1).WithSymbol("out"),
				asm.Return(),
			},
		})
		if err != nil {
			n.t.Fatalf("load %s: %v", name, err)
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: n.CgroupRoot, Attach: attach, Program: prog})
		prog.Close()
		if err != nil {
			n.t.Fatalf("attach %s to %s: %v", name, n.CgroupRoot, err)
		}
		n.t.Cleanup(func() { l.Close() })
	}
	translate("lb_connect4", ebpf.AttachCGroupInet4Connect, vip, backend)
	translate("lb_getpeername4", ebpf.AttachCgroupInet4GetPeername, backend, vip)
}

// wireIP4 and wirePort are an address and a port as the programs load
// them from struct bpf_sock_addr: network byte order, read as a
// little-endian word.
func wireIP4(a netip.Addr) int32 { b := a.As4(); return int32(binary.LittleEndian.Uint32(b[:])) }
func wirePort(p uint16) int32 {
	return int32(binary.LittleEndian.Uint16(binary.BigEndian.AppendUint16(nil, p)))
}
