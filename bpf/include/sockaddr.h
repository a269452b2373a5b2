/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Copyright ambient-ebpf authors */

/* A socket's local and remote addresses as struct ae_addr (IPv4 as
 * IPv4-mapped), from sockops and struct bpf_sock; shared by the socket
 * programs and the sockmap acceleration. */
#ifndef AMBIENT_SOCKADDR_H
#define AMBIENT_SOCKADDR_H

#include "lib.h"

/*
 * Socket addresses are read unconditionally and pinned in registers before
 * the family is looked at. Otherwise clang merges the IPv4 and IPv6 loads
 * into one load at a computed offset, which the verifier refuses for
 * context and socket pointers.
 */

static __always_inline void pick_addr(struct ae_addr *a, __u32 family, __u32 v4, __u32 w0, __u32 w1,
				      __u32 w2, __u32 w3)
{
	barrier_var(v4);
	barrier_var(w0);
	barrier_var(w1);
	barrier_var(w2);
	barrier_var(w3);
	if (family == AF_INET) {
		addr_set_v4(a, v4);
	} else {
		__u32 ip6[4] = {w0, w1, w2, w3};

		addr_set_v6(a, ip6);
	}
}

static __always_inline void sockops_local(struct bpf_sock_ops *skops, struct ae_addr *a)
{
	pick_addr(a, skops->family, skops->local_ip4, skops->local_ip6[0], skops->local_ip6[1],
		  skops->local_ip6[2], skops->local_ip6[3]);
}

static __always_inline void sockops_remote(struct bpf_sock_ops *skops, struct ae_addr *a)
{
	pick_addr(a, skops->family, skops->remote_ip4, skops->remote_ip6[0], skops->remote_ip6[1],
		  skops->remote_ip6[2], skops->remote_ip6[3]);
}

static __always_inline void sock_remote(struct bpf_sock *sk, struct ae_addr *a)
{
	pick_addr(a, sk->family, sk->dst_ip4, sk->dst_ip6[0], sk->dst_ip6[1], sk->dst_ip6[2], sk->dst_ip6[3]);
}

static __always_inline void sock_local(struct bpf_sock *sk, struct ae_addr *a)
{
	pick_addr(a, sk->family, sk->src_ip4, sk->src_ip6[0], sk->src_ip6[1], sk->src_ip6[2], sk->src_ip6[3]);
}

#endif /* AMBIENT_SOCKADDR_H */
