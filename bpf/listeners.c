// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Files the inbound listeners ztunnel already has in a pod's netns into
 * ae_listeners, for the pod's sk_lookup program (R5).
 *
 * sockops files a listener when it starts listening (on_listen in
 * sock.c), and only in an enrolled pod's netns, which is after the pod's
 * enrolment in the usual order: the pod is enrolled, then handed to
 * ztunnel, which then opens its listeners. When ztunnel listened first (a
 * takeover from istio-cni, whose pods ztunnel already serves, pins lost
 * while ztunnel ran, or a listener that started before the pod's ae_netns
 * entry was written), sockops filed nothing: the agent runs this iterator
 * over the pod netns's TCP sockets (the netns it is created in) at
 * enrolment, before the pod's entries for a running pod and after them
 * for every pod, and when its resync finds an enrolled pod with no
 * listener filed (one the full map left out). It runs
 * only in the sk_lookup mode (Linux 5.17), whose kernels have everything
 * it uses: iter/tcp (5.9), sockhash updates from an iterator (5.10) and
 * struct net's net_cookie (5.12).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>
#include "maps.h"
#include "lib.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define TCP_LISTEN 10

/* file_listener puts the listener in the first free slot of its netns's.
 * The agent runs the iterator only for a pod none of whose listeners is
 * filed, so no socket takes two slots. */
static __always_inline void file_listener(struct sock_common *skc, __u64 netns_cookie)
{
	struct listener_key key = {};
	__u16 i;

	key.netns_cookie = netns_cookie;
	key.port = ae_cfg.inbound_port;
	for (i = 0; i < AE_LISTENER_SLOTS; i++) {
		key.idx = i;
		if (bpf_map_update_elem(&ae_listeners, &key, skc, BPF_NOEXIST) == 0)
			return;
	}
}

SEC("iter/tcp")
int ae_file_listeners(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct tcp_sock *tp;

	if (!skc || skc->skc_state != TCP_LISTEN || skc->skc_num != ae_cfg.inbound_port)
		return 0;
	/* Only full sockets carry a mark; listeners are. */
	tp = bpf_skc_to_tcp_sock(skc);
	if (!tp || !mark_is_ztunnel(tp->inet_conn.icsk_inet.sk.sk_mark))
		return 0;
	file_listener(skc, BPF_CORE_READ(skc, skc_net.net, net_cookie));
	return 0;
}
