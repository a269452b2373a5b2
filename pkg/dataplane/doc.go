// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package dataplane owns the eBPF data path: it loads the objects compiled
// from bpf/ (package bpfobj), attaches them with bpf_link, pins everything
// under one bpffs directory, and keeps the maps in step with the enrolled
// pods: New (which adopts what an earlier agent pinned), Enroll, Remove,
// List, Close, Uninstall.
//
// The data path is bpf/ and this package. Everything else about the pins
// is a room of its own below it, and imports run one way (dataplane ->
// inspect -> accel -> bpfobj; dataplane -> upgrade -> bpfobj):
//
//	bpfobj   the compiled objects, their map types, common.h's constants,
//	         the pin directories and the hook tables
//	accel    the optional sockmap acceleration (bpf/accel.c)
//	upgrade  the layout record and the upgrade of an older agent's pins;
//	         New hands it the specs it is about to load
//	inspect  read-only views of the pins for the CLI, doctor and metrics:
//	         pods, maps, stats, why, trace, hooks
//	nsexec   running a function inside a network namespace
//
// What runs where:
//
//   - bpf/sock.c, attached once to the pods' cgroup (Config.PodsCgroup; a
//     node-wide half for host probes on the root where bpf/probe.c does not
//     file them) or, with per-pod socket
//     hooks (Config.SocketHooks), to each enrolled pod's cgroup and
//     ztunnel's: connect4 and
//     connect6 send enrolled pods' outbound TCP to ztunnel's :15001 (R1),
//     sockops and getsockopt let ztunnel read the original destination with
//     an unmodified getsockopt(SO_ORIGINAL_DST). Pods are recognised by
//     netns cookie, so the shared hooks cost one hash lookup for everyone
//     else; per-pod hooks cost them nothing but the root's half.
//     sockops also files ztunnel's inbound listeners in enrolled pods
//     (ae_listeners) and its deliveries to the app (ae_local_flows) for
//     the pod's sk_lookup; the agent's resync files those the full table
//     left out (ResyncListeners). Who can fill each shared map:
//     docs/CONTRACT.md, "Shared capacity".
//   - bpf/accel.c, only with Config.SockmapAccel (Linux 5.15): the
//     sockmap acceleration of the pod-local app <-> ztunnel hop, its own
//     room (package accel), started and removed from here.
//   - bpf/tc.c, per pod: the sk_lookup program in the pod netns hands new
//     inbound flows to ztunnel's :15006 (R5); a tc program on the pod's lo
//     gives ztunnel's deliveries the return mark (R10); in the SNAT
//     host-probe mode (Config.HostProbes), two on the node side of the
//     pod's veth translate host probes (H1). In the direct mode the node's
//     own connections are filed for the pod's inbound hook, which passes
//     each one's SYN once (probes_linux.go).
//   - bpf/probe.c, in the direct host-probe mode where the kernel takes
//     fentry: files the node's probes at tcp_connect(), one call per
//     connect, so that nothing of ours runs on the node's cgroup root.
//
// Enrolment waits for nothing: per-pod TC programs are classic tc filters
// (a TCX attach waits for an RCU grace period, about 16 ms), the sk_lookup
// program is a netns link, and the rest are map writes, one policy rule
// and route, and a sysctl. Each pod's slot in ae_pod_meta is a journal:
// written "enrolling" (with the netns path and the pod's own
// tcp_fwmark_accept) before the node is touched, "enrolled" after the
// last map entry, "removing" before anything is taken away. New undoes
// whatever a killed agent left enrolling or removing.
//
// ae_pods has one owner per address (H4). Enroll refuses an address
// another enrolled pod still has in its netns (ErrDuplicateIP): a
// duplicate never takes a running pod's inbound capture. An owner that no
// longer has it (a missed DEL) is removed first. A pod whose entry is lost
// anyway (pins of an agent before the refusal) keeps the address through
// ae_netns, is reported (inspect.EnrolledPod.Problem), and New restores
// the entry.
//
// Pinned layout under Config.BPFFSDir (default /sys/fs/bpf/ambient-ebpf):
//
//	ae_layout           the layout record: the pins' layout, the oldest
//	                    layout that may take them over, the agent build
//	                    that wrote them, an upgrade in progress
//	next/<map>          during an upgrade (package upgrade): a map of the
//	                    new layout being filled, renamed over maps/<map>
//	                    when done
//	maps/ae_pods        enrolled pods by IP (IPv4 as ::ffff:a.b.c.d)
//	maps/ae_netns       enrolled pods by netns cookie
//	maps/ae_pod_meta    the journal: uid, namespace, name, netns, state per slot
//	maps/ae_stats       per-pod counters (per CPU, by slot)
//	maps/ae_sk_dst      original destination per socket (socket storage)
//	maps/ae_orig_dst    original destination by client address
//	maps/ae_probe_nat   host probes: SNAT translations, or node sockets' flows (direct)
//	maps/ae_listeners   ztunnel's inbound listeners by netns (sockhash)
//	maps/ae_local_flows ztunnel's connections to its pod's app (R10)
//	maps/ae_steer       flows tc hands to sk_lookup (older kernels, R14)
//	maps/ae_node_cfg    the node-wide settings the programs were loaded with
//	maps/ae_decisions   decisions by reason (per CPU), and trace events lost
//	maps/ae_trace       the ring buffer of decision events (while tracing)
//	maps/ae_tracing     the flag that switches the events on (bpf/include/trace.h)
//	links/<hook>        node-wide cgroup links: connect4, connect6,
//	                    sendmsg4, sendmsg6, recvmsg4, recvmsg6,
//	                    getpeername4, getpeername6, sockops, getsockopt;
//	                    on Config.PodsCgroup when set, else on the root
//	                    (not with per-pod socket hooks, Config.SocketHooks)
//	links/node_<hook>   with Config.PodsCgroup, the node-wide half on the
//	                    root: connect4, connect6, sockops (host probes),
//	                    where links/probe_connect is not
//	links/probe_connect bpf/probe.c's fentry link on tcp_connect() (direct
//	                    host probes, where the kernel takes fentry)
//	ztunnel/<id>/cg_<hook>  per-pod socket hooks: every socket program on
//	                    the cgroup of id, one of ztunnel's (AttachZtunnel)
//	maps/ae_accel*, links/accel_*  the sockmap acceleration, when
//	                    Config.SockmapAccel asks for it (package accel)
//	pods/<uid>/sk_lookup     sk_lookup link in the pod netns (R5)
//	pods/<uid>/lo_ingress    tc ingress on the pod's lo (R10)
//	pods/<uid>/reroute_<if>  tc ingress on a virtual interface (R14)
//	pods/<uid>/host_egress   tc on the node side of the pod's veth (H1, SNAT mode only)
//	pods/<uid>/host_ingress
//	pods/<uid>/ingress       tc ingress on the pod's interface (R5, kernels
//	                         before 5.17 only)
//	pods/<uid>/cg_<hook>     per-pod socket hooks: every socket program on
//	                         the pod's cgroup
//
// The uid is validated before it names a directory (ValidUID). Each tc
// pin is the program of a classic tc filter: clsact qdisc (created when
// missing, never deleted), cls_bpf at priority 0xae00, handle 0xae, named
// ae_<pin>; only that filter is ever replaced or deleted. The agent keeps
// no descriptor of a pod's programs or links: the pins (and the filters)
// hold them, every filter runs the one shared program of its kind (its
// classid names the pod), and a removal opens the pins it needs, so the
// agent's descriptors do not grow with its pods. The mechanisms
// follow the kernel (package features, docs/KERNELS.md): where
// sk_lookup sees the ingress interface (5.17) it alone captures inbound
// flows; before that a tc program on the pod's interface files each flow
// for it.
//
// Decisions are counted always and traced only while a tracer has set
// ae_tracing; the programs check the flag, a global, before building an
// event. The read-only views of the pins (pods, maps, why, trace, hooks)
// are package inspect's.
//
// Pins outlive the agent: while it restarts or upgrades, redirection keeps
// working, and New adopts what it finds (links are updated in place to the
// new programs, so there is no moment without redirection). Pins of
// another layout are upgraded first (package upgrade: new maps filled
// before any program uses them, entries converted by the maps' BTF); pins
// of a layout this build cannot take over are refused before anything is
// touched. Uninstall removes all of it.
package dataplane
