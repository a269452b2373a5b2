// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bpfobj

import (
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
)

// NodeHook is one of the node-wide cgroup hooks, pinned as links/<Name>.
type NodeHook struct {
	Name   string
	Attach ebpf.AttachType
	// Program picks the hook's program from the loaded sock object.
	Program func(*SockPrograms) *ebpf.Program
}

// NodeHooks lists the node-wide cgroup hooks, in the order they attach.
func NodeHooks() []NodeHook {
	return []NodeHook{
		{"connect4", ebpf.AttachCGroupInet4Connect, func(p *SockPrograms) *ebpf.Program { return p.AeConnect4 }},
		{"connect6", ebpf.AttachCGroupInet6Connect, func(p *SockPrograms) *ebpf.Program { return p.AeConnect6 }},
		{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(p *SockPrograms) *ebpf.Program { return p.AeSendmsg4 }},
		{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(p *SockPrograms) *ebpf.Program { return p.AeSendmsg6 }},
		{"recvmsg4", ebpf.AttachCGroupUDP4Recvmsg, func(p *SockPrograms) *ebpf.Program { return p.AeRecvmsg4 }},
		{"recvmsg6", ebpf.AttachCGroupUDP6Recvmsg, func(p *SockPrograms) *ebpf.Program { return p.AeRecvmsg6 }},
		{"getpeername4", ebpf.AttachCgroupInet4GetPeername, func(p *SockPrograms) *ebpf.Program { return p.AeGetpeername4 }},
		{"getpeername6", ebpf.AttachCgroupInet6GetPeername, func(p *SockPrograms) *ebpf.Program { return p.AeGetpeername6 }},
		{"sockops", ebpf.AttachCGroupSockOps, func(p *SockPrograms) *ebpf.Program { return p.AeSockops }},
		{"getsockopt", ebpf.AttachCGroupGetsockopt, func(p *SockPrograms) *ebpf.Program { return p.AeGetsockopt }},
	}
}

// NodeScopeHooks are the hooks of the node-wide half of a split attach
// (dataplane.Config.PodsCgroup): the node's own sockets' connects and
// sockops (host probes), at the cgroup root, pinned as links/node_<name>.
func NodeScopeHooks() []NodeHook {
	var out []NodeHook
	for _, h := range NodeHooks() {
		switch h.Name {
		case "connect4", "connect6", "sockops":
			h.Name = NodeScopePrefix + h.Name
			out = append(out, h)
		}
	}
	return out
}

// ProbeConnectPin is the pin under links/ of bpf/probe.c's fentry link on
// tcp_connect() (the direct host-probe mode where the kernel takes it).
const ProbeConnectPin = "probe_connect"

// NodeScopePrefix starts the pin names of NodeScopeHooks.
const NodeScopePrefix = "node_"

// CgroupHooks are the socket programs of one cgroup in the per-pod mode
// (dataplane.SocketHooksPods): every node hook, on an enrolled pod's
// cgroup, pinned as pods/<uid>/cg_<name>, or on ztunnel's, pinned as
// ztunnel/<cgroup id>/cg_<name>.
func CgroupHooks() []NodeHook {
	out := NodeHooks()
	for i := range out {
		out[i].Name = CgroupPrefix + out[i].Name
	}
	return out
}

// CgroupPrefix starts the pin names of CgroupHooks.
const CgroupPrefix = "cg_"

// IsCgroupPin reports whether a pod pin is one of CgroupHooks.
func IsCgroupPin(pin string) bool { return strings.HasPrefix(pin, CgroupPrefix) }

// PodHook is where one of a pod's programs goes, pinned as
// pods/<uid>/<Pin>.
type PodHook struct {
	Pin    string
	Netns  string // path of the netns the interface is in
	Iface  string // empty for sk_lookup
	Attach ebpf.AttachType
	// Classid of a tc filter: the pod's slot + 1, which the program
	// reads as skb->tc_classid to name its pod in trace events.
	Classid uint32
}

// PodHooks lists where the programs of the pod in slot go: in its netns
// (netns, with its interface iface and virtual interfaces reroute) and on
// the node side of its veth (hostIf in nodeNetns; none when hostIf is "",
// as in the direct host-probe mode). tcIngress: sk_lookup cannot capture
// inbound flows alone (before 5.17) and a tc program on the pod's
// interface files them for it.
func PodHooks(netns, iface string, reroute []string, hostIf, nodeNetns string, slot uint32, tcIngress bool) []PodHook {
	in := func(pin, iface string) PodHook {
		return PodHook{Pin: pin, Netns: netns, Iface: iface, Attach: ebpf.AttachTCXIngress, Classid: slot + 1}
	}
	var hooks []PodHook
	if tcIngress {
		hooks = append(hooks, in("ingress", iface))
	}
	hooks = append(hooks, in("lo_ingress", "lo"))
	for _, v := range reroute {
		hooks = append(hooks, in("reroute_"+v, v))
	}
	hooks = append(hooks, PodHook{Pin: "sk_lookup", Netns: netns, Attach: ebpf.AttachSkLookup})
	if hostIf == "" {
		return hooks
	}
	return append(hooks,
		PodHook{Pin: "host_egress", Netns: nodeNetns, Iface: hostIf, Attach: ebpf.AttachTCXEgress, Classid: slot + 1},
		PodHook{Pin: "host_ingress", Netns: nodeNetns, Iface: hostIf, Attach: ebpf.AttachTCXIngress, Classid: slot + 1},
	)
}

// RerouteInterface is the virtual interface a reroute_<if> pin names.
func RerouteInterface(pin string) (string, bool) { return strings.CutPrefix(pin, "reroute_") }

// Our classic tc filters are recognised by priority, handle and name
// together; no other filter is ever replaced or deleted. The priority is
// high (runs late), so filters other software put first keep running
// first, as TCX's append does.
const (
	TCFilterPriority = 0xae00
	TCFilterHandle   = 0xae
)

// TCFilterName names a filter after its pin ("ae_ingress"), which tc
// shows.
func TCFilterName(pin string) string { return "ae_" + pin }

// TCParent is the clsact parent of a tc hook's direction.
func TCParent(attach ebpf.AttachType) uint32 {
	if attach == ebpf.AttachTCXEgress {
		return netlink.HANDLE_MIN_EGRESS
	}
	return netlink.HANDLE_MIN_INGRESS
}

// OurFilter reports whether bf is the filter of the pod program pinned
// as pin.
func OurFilter(pin string, bf *netlink.BpfFilter) bool {
	return bf.Priority == TCFilterPriority && bf.Handle == TCFilterHandle && bf.Name == TCFilterName(pin)
}
