/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Copyright ambient-ebpf authors */

/*
 * The maps every object shares. They are pinned by name under
 * <bpffs root>/maps/, so the socket object and the TC object (loaded
 * separately) use the same instances, and a restarted agent adopts them
 * with all their entries: redirection never stops while it is away.
 * Names stay within the kernel's 15 characters.
 */
#ifndef AMBIENT_MAPS_H
#define AMBIENT_MAPS_H

#include "common.h"

/* Enrolled pods by IP (R5 and the host side). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2 * AE_MAX_PODS);
	__type(key, struct ae_addr);
	__type(value, struct pod_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_pods SEC(".maps");

/* Enrolled pods by netns cookie (the socket hooks). Scoping by netns,
 * never by cgroup id: a pod's containers share its netns, not a cgroup. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, AE_MAX_PODS);
	__type(key, __u64);
	__type(value, struct netns_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_netns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, AE_MAX_PODS);
	__type(key, __u32);
	__type(value, struct pod_meta);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_pod_meta SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AE_MAX_PODS);
	__type(key, __u32);
	__type(value, struct pod_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_stats SEC(".maps");

/* Original destination per redirected socket, from connect() until the
 * connection is established; socket storage frees itself with the socket. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct orig_dst);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_sk_dst SEC(".maps");

/* Original destination by client address, for the proxy's getsockopt.
 * Entries are deleted when the client socket closes (sockops state
 * callback); not LRU, so a live entry is never evicted. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 262144);
	__type(key, struct orig_key);
	__type(value, struct orig_dst);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_orig_dst SEC(".maps");

/* Host probes (H1): connections from sockets of the node's netns to an
 * enrolled pod. In SNAT mode the translation, made by the SYN leaving the
 * node (bpf/tc.c, snat_probe), which lives exactly as long as the prober's
 * socket: the sockops state callback deletes it when that socket closes.
 * In direct mode the flow itself, filed before the SYN leaves (bpf/probe.c
 * at tcp_connect(), or sockops: bpf/sock.c, file_direct_probe), which the
 * pod's programs let through untranslated once and delete; one no SYN used
 * expires after AE_PROBE_FLOW_TTL_NS and the agent sweeps it. Either way
 * the table holds only live connections or SYNs in flight. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct probe_key);
	__type(value, struct probe_nat);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_probe_nat SEC(".maps");

/* Flows handed to ztunnel's listeners through sk_lookup, on kernels whose
 * tc bpf_sk_assign refuses reuseport listeners (before 6.5; ztunnel's are
 * all SO_REUSEPORT). The TC program files the listener under the flow, the
 * pod's sk_lookup program assigns it and deletes the entry. An entry whose
 * SYN never reached the lookup stays until the tuple is reused or the
 * listener closes (sockmaps drop closed sockets). */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct steer_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_steer SEC(".maps");

/* ztunnel's inbound listeners in enrolled pods, filed by sockops when
 * they listen (TCP_LISTEN_CB) and dropped by the kernel when they close.
 * The pod's sk_lookup program hands new inbound flows to them (R5):
 * sk_lookup cannot look sockets up by address, only take them from a
 * sockmap. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, AE_MAX_PODS * AE_LISTENER_SLOTS);
	__type(key, struct listener_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_listeners SEC(".maps");

/* ztunnel's connections to the app of its own pod (R10: it delivers
 * inbound traffic from the client's address over lo), filed by sockops
 * before the SYN leaves (or, for a connect the pod's enrolment overtook,
 * by the pod's lo program as the SYN arrives) and removed when the socket
 * closes. sk_lookup sees
 * the SYN with the pod interface's index (the route to a local address
 * names the device that owns it) and a foreign source, exactly like
 * traffic from outside: this is how it tells them apart. Key as sk_lookup
 * sees the flow: saddr/sport the client side, daddr/dport the app's. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 18);
	__type(key, struct steer_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_local_flows SEC(".maps");

/* The node-wide settings the programs were loaded with (ae_cfg in lib.h),
 * for user space: `ambient-ebpf why` and trace read the ports, marks,
 * probe addresses and mechanisms here. No program reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct ae_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_node_cfg SEC(".maps");

/* Decisions the programs made, by reason (enum ae_reason), per CPU: the
 * agent's Prometheus counters. Always counted, tracing or not. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, AE_DECISION_SLOTS);
	__type(key, enum ae_reason);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_decisions SEC(".maps");

/* Decision events (struct ae_event) for `ambient-ebpf trace`, written
 * only while ae_tracing is set (see trace.h); one reader at a time. The
 * value type only puts struct ae_event into BTF (for bpf2go); a ring
 * buffer has no value size. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
	__type(value, struct ae_event);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_trace SEC(".maps");

#endif /* AMBIENT_MAPS_H */
