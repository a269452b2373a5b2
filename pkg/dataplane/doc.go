// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package dataplane owns the eBPF data path: it loads the objects compiled
// from bpf/, attaches them with bpf_link, pins everything under one bpffs
// directory, and keeps the maps in step with the enrolled pods.
//
// What runs where:
//
//   - bpf/sock.c, attached once to the node's cgroup v2 root: connect4 and
//     connect6 send enrolled pods' outbound TCP to ztunnel's :15001 (R1),
//     sockops and getsockopt let ztunnel read the original destination with
//     an unmodified getsockopt(SO_ORIGINAL_DST). Pods are recognised by
//     netns cookie, so the hooks cost one hash lookup for everyone else.
//   - bpf/tc.c, one TC ingress program per pod on the pod's interface inside
//     its netns: inbound TCP goes to ztunnel's :15006 (R5).
//
// Pinned layout under Config.BPFFSDir (default /sys/fs/bpf/ambient-ebpf):
//
//	maps/ae_pods        enrolled pods by IP (IPv4 as ::ffff:a.b.c.d)
//	maps/ae_netns       enrolled pods by netns cookie
//	maps/ae_pod_meta    uid, namespace, name per slot (user space only)
//	maps/ae_stats       per-pod counters (per CPU, by slot)
//	maps/ae_sk_dst      original destination per socket (socket storage)
//	maps/ae_orig_dst    original destination by client address
//	maps/ae_probe_nat   host-probe SNAT translations
//	links/<hook>        node-wide cgroup links: connect4, connect6,
//	                    sendmsg4, sendmsg6, recvmsg4, recvmsg6,
//	                    getpeername4, getpeername6, sockops, getsockopt
//	pods/<uid>/ingress       TC ingress on the pod's interface (R5)
//	pods/<uid>/lo_ingress    TC ingress on the pod's lo (R10)
//	pods/<uid>/reroute_<if>  TC ingress on a virtual interface (R14)
//	pods/<uid>/host_egress   TC on the node side of the pod's veth (H1)
//	pods/<uid>/host_ingress
//	pods/<uid>/sk_lookup     sk_lookup in the pod netns (hand-over where tc cannot)
//
// The mechanisms follow the kernel (package features, README:
// Compatibility): with TCX (Linux 6.6) each pods/<uid>/ pin is a TCX link
// and inbound flows are handed over by tc's bpf_sk_assign; without it, the
// pin is the program of a classic tc filter (clsact qdisc, cls_bpf at
// priority 0xae00, handle 0xae, named ae_<pin>), and inbound flows reach
// ztunnel's reuseport listeners through the sk_lookup program.
//

// Pins outlive the agent: while it restarts or upgrades, redirection keeps
// working, and New adopts what it finds (links are updated in place to the
// new programs, so there is no moment without redirection). Uninstall
// removes all of it.
package dataplane
