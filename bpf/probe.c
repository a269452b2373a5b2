// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Host probes in the direct mode (H1) with nothing on the node's cgroup
 * root.
 *
 * A connection from a socket of the node's netns to an enrolled pod must
 * reach the app, not ztunnel; the pod's programs pass exactly the flows
 * filed in ae_probe_nat (node_probe in tc.c). Filing needs the socket's
 * source port, which is chosen after the connect hook: sockops' connect
 * callback has it, but a sockops program on the root runs nine times for
 * every TCP connection of the node, in the mesh or not, some 0.5 us that
 * no program body can lower (issue 35, bystander_floor_bpf_ns).
 *
 * The kernel calls tcp_connect() once per active TCP open, after the
 * source address and port are chosen and before the SYN is built, for
 * every socket of every netns: an fentry program there (a BPF trampoline,
 * about the price of a function call) runs once per connect, and for the
 * node's own sockets it is the only one of ours. A socket of the node's
 * netns (by its netns's inode number) connecting to an enrolled pod files
 * its flow here.
 *
 * No close is seen here. The entry serves the SYN only (later segments
 * belong to the app's socket), so the pod's program removes it when it
 * passes the SYN, honours it for AE_PROBE_FLOW_TTL_NS after the connect
 * at most, and the agent sweeps the ones no SYN used. A forwarded
 * connection cannot take the same flow meanwhile: the node's conntrack
 * holds the probe's tuple longer than that.
 *
 * The program files only while ae_node_cfg (rewritten by every agent that
 * starts) says so: left attached by an agent of an older build, which
 * knows neither the link nor the sweep, it files nothing.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>
#include "maps.h"
#include "lib.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define AF_INET  2
#define AF_INET6 10

/* The node's netns, by inode number; set before the program loads. */
const volatile __u32 ae_node_netns_ino = 0;

/* ae_decisions, as count_decision in trace.h, whose tracing switch this
 * object has no use for. */
static __always_inline void count(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&ae_decisions, &reason);

	if (n)
		(*n)++;
}

/* Files a probe's flow; an entry of the same flow from another address is
 * taken over once it has expired, and left alone before (the probe is
 * then captured like any other inbound flow). */
static __always_inline void file_probe_flow(const struct probe_key *key, struct probe_nat *nat, __u32 slot)
{
	struct pod_stats *st;
	struct probe_nat *old;

	if (bpf_map_update_elem(&ae_probe_nat, key, nat, BPF_NOEXIST)) {
		old = bpf_map_lookup_elem(&ae_probe_nat, key);
		if (!old) {
			count(AE_R_PROBE_TABLE_FULL);
			return;
		}
		if (!addr_eq(&old->host, &nat->host) && nat->last_seen_ns - old->last_seen_ns < AE_PROBE_FLOW_TTL_NS) {
			count(AE_R_PROBE_PORT_TAKEN);
			return;
		}
		*old = *nat;
	}
	st = pod_stats(slot);
	if (st)
		st->probe_snat++;
}

SEC("fentry/tcp_connect")
int BPF_PROG(ae_probe_connect, struct sock *sk)
{
	struct sock_common *skc = &sk->__sk_common;
	struct probe_key key = {};
	struct probe_nat nat = {};
	struct ae_config *cfg;
	struct pod_info *pod;
	__u32 zero = 0;

	/* Every connect of the node passes here: the netns test first. */
	if (skc->skc_net.net->ns.inum != ae_node_netns_ino)
		return 0;
	cfg = bpf_map_lookup_elem(&ae_node_cfg, &zero);
	if (!cfg || !(cfg->flags & AE_CFG_PROBE_CONNECT))
		return 0;
	/* An IPv6 socket connecting to an IPv4 address holds both as
	 * IPv4-mapped, the form ae_pods is keyed by. */
	if (skc->skc_family == AF_INET) {
		addr_set_v4(&key.pod, skc->skc_daddr);
		addr_set_v4(&nat.host, skc->skc_rcv_saddr);
	} else if (skc->skc_family == AF_INET6) {
		BPF_CORE_READ_INTO(&key.pod, skc, skc_v6_daddr);
		BPF_CORE_READ_INTO(&nat.host, skc, skc_v6_rcv_saddr);
	} else {
		return 0;
	}
	/* What the pod's programs pass before they look for a probe (ingress
	 * mode, HBONE) would leave the entry unused until the sweep. */
	pod = bpf_map_lookup_elem(&ae_pods, &key.pod);
	if (!pod || (pod->flags & AE_F_BYPASS_INBOUND) || skc->skc_dport == bpf_htons(ae_cfg.hbone_port))
		return 0;
	key.pod_port = skc->skc_dport;
	key.host_port = bpf_htons(skc->skc_num);
	nat.last_seen_ns = bpf_ktime_get_ns();
	file_probe_flow(&key, &nat, pod->slot);
	return 0;
}
