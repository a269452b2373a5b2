// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Outbound capture with cgroup socket hooks, attached once to the node's
 * cgroup v2 root and scoped to enrolled pods by netns cookie.
 *
 *   connect4/connect6  R1: rewrite the destination of an enrolled pod's TCP
 *                      connect to the pod's own IP and ztunnel's :15001,
 *                      keeping the original in socket storage.
 *   sockops            when the redirected socket starts connecting, file
 *                      the original destination under its local address
 *                      and port: the peer the proxy's accepted socket sees.
 *   getsockopt         answer SO_ORIGINAL_DST (SOL_IP and SOL_IPV6, 80) for
 *                      that accepted socket, so an unmodified ztunnel learns
 *                      where the app wanted to go.
 *
 * No packet is rewritten and no conntrack entry is made: the connection
 * really is pod -> ztunnel.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "lib.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define SYS_PROCEED 1
#define SYS_REJECT  0

#define SOL_IP            0
#define SOL_IPV6          41
#define SO_ORIGINAL_DST   80 /* IPv4 SOL_IP and IP6T_SO_ORIGINAL_DST share the number */
#define IPPROTO_TCP_      6
#define PAGE_SIZE_        4096

struct sockaddr_in_ {
	__u16 family;
	__be16 port;
	__be32 addr;
	__u8 zero[8];
};

struct sockaddr_in6_ {
	__u16 family;
	__be16 port;
	__be32 flowinfo;
	__u32 addr[4];
	__u32 scope_id;
};

/*
 * Returns the pod the socket's netns belongs to, or NULL when the socket
 * is not one to capture: not in an enrolled netns, not TCP, or opened by
 * ztunnel itself (R2: every ztunnel socket carries mark 0x539).
 */
static __always_inline struct netns_info *capturable(struct bpf_sock_addr *ctx)
{
	struct bpf_sock *sk = ctx->sk;
	struct netns_info *ns;
	__u64 cookie;

	if (ctx->protocol != IPPROTO_TCP_)
		return NULL;
	cookie = bpf_get_netns_cookie(ctx);
	ns = bpf_map_lookup_elem(&ae_netns, &cookie);
	if (!ns)
		return NULL;
	if (!sk || mark_is_ztunnel(sk->mark))
		return NULL;
	return ns;
}

/*
 * Keeps the original destination with the socket. Failing to keep it
 * fails the connect: a redirected connection whose destination ztunnel
 * cannot learn would be misrouted, and an error is better than that.
 */
static __always_inline int remember_orig_dst(struct bpf_sock_addr *ctx, struct netns_info *ns,
					     const struct ae_addr *dst, __u16 family)
{
	struct orig_dst *od;
	struct pod_stats *st;

	od = bpf_sk_storage_get(&ae_sk_dst, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!od) {
		st = pod_stats(ns->slot);
		if (st)
			st->orig_dst_errors++;
		return -1;
	}
	od->addr = *dst;
	od->port = (__be16)ctx->user_port;
	od->family = family;
	return 0;
}

static __always_inline void count_outbound(struct netns_info *ns)
{
	struct pod_stats *st = pod_stats(ns->slot);

	if (st)
		st->outbound_redirects++;
}

/* R1 for an IPv4 destination; R3, R4 and R8 leave it alone. */
static __always_inline int connect4_redirect(struct bpf_sock_addr *ctx)
{
	struct netns_info *ns = capturable(ctx);
	struct ae_addr dst;
	__be32 ip;

	if (!ns)
		return SYS_PROCEED;
	ip = ctx->user_ip4;
	addr_set_v4(&dst, ip);
	if (ip4_is_loopback(ip) || addr_eq(&dst, &ns->ip4) || addr_eq(&dst, (struct ae_addr *)&ae_cfg.probe_v4))
		return SYS_PROCEED;
	if (remember_orig_dst(ctx, ns, &dst, AF_INET))
		return SYS_REJECT;
	/* The pod's own address (not 127.0.0.1) as the new destination makes
	 * the kernel pick the pod IP as source, so ztunnel sees the same peer
	 * as with iptables' REDIRECT. A pod without IPv4 falls back to loopback. */
	ctx->user_ip4 = (ns->flags & AE_F_HAS_V4) ? addr_words(&ns->ip4)[3] : bpf_htonl(0x7f000001);
	ctx->user_port = bpf_htons(ae_cfg.outbound_port);
	count_outbound(ns);
	return SYS_PROCEED;
}

/*
 * R1/R15 for IPv6 sockets. Dual-stack clients (Java, for one) reach IPv4
 * peers through IPv4-mapped addresses; the kernel then connects over IPv4
 * without running connect4, so the mapped case is handled here as IPv4.
 */
static __always_inline int connect6_redirect(struct bpf_sock_addr *ctx)
{
	struct netns_info *ns = capturable(ctx);
	struct ae_addr dst, *self, *probe;
	__u32 ip6[4];
	__u16 family;

	if (!ns)
		return SYS_PROCEED;
	ip6[0] = ctx->user_ip6[0];
	ip6[1] = ctx->user_ip6[1];
	ip6[2] = ctx->user_ip6[2];
	ip6[3] = ctx->user_ip6[3];
	addr_set_v6(&dst, ip6);
	if (ip6_is_v4_mapped(ip6)) {
		if (ip4_is_loopback(ip6[3]))
			return SYS_PROCEED;
		family = AF_INET;
		self = &ns->ip4;
		probe = (struct ae_addr *)&ae_cfg.probe_v4;
	} else {
		if (ip6_is_loopback(ip6))
			return SYS_PROCEED;
		family = AF_INET6;
		self = &ns->ip6;
		probe = (struct ae_addr *)&ae_cfg.probe_v6;
	}
	if (addr_eq(&dst, self) || addr_eq(&dst, probe))
		return SYS_PROCEED;
	if (remember_orig_dst(ctx, ns, &dst, family))
		return SYS_REJECT;

	if (family == AF_INET && !(ns->flags & AE_F_HAS_V4)) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
		ctx->user_ip6[3] = bpf_htonl(0x7f000001);
	} else if (family == AF_INET6 && !(ns->flags & AE_F_HAS_V6)) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = 0;
		ctx->user_ip6[3] = bpf_htonl(1);
	} else {
		__u32 *w = addr_words(self);

		ctx->user_ip6[0] = w[0];
		ctx->user_ip6[1] = w[1];
		ctx->user_ip6[2] = w[2];
		ctx->user_ip6[3] = w[3];
	}
	ctx->user_port = bpf_htons(ae_cfg.outbound_port);
	count_outbound(ns);
	return SYS_PROCEED;
}

/* cgroup/connect4: every IPv4 connect() below the node's cgroup root. */
SEC("cgroup/connect4")
int ae_connect4(struct bpf_sock_addr *ctx)
{
	return connect4_redirect(ctx);
}

/* cgroup/connect6: every IPv6 connect(), IPv4-mapped included. */
SEC("cgroup/connect6")
int ae_connect6(struct bpf_sock_addr *ctx)
{
	return connect6_redirect(ctx);
}

static __always_inline int orig_key_of_local(struct bpf_sock_ops *skops, struct orig_key *key)
{
	__builtin_memset(key, 0, sizeof(*key));
	key->netns_cookie = bpf_get_netns_cookie(skops);
	if (skops->family == AF_INET) {
		addr_set_v4(&key->addr, skops->local_ip4);
	} else if (skops->family == AF_INET6) {
		__u32 ip6[4] = {skops->local_ip6[0], skops->local_ip6[1], skops->local_ip6[2],
				skops->local_ip6[3]};

		addr_set_v6(&key->addr, ip6);
	} else {
		return -1;
	}
	/* sockops gives the local port in host byte order. */
	key->port = bpf_htons((__u16)skops->local_port);
	return 0;
}

/*
 * The redirected socket has its local port now (TCP_CONNECT_CB runs just
 * before the SYN is sent), so its original destination can be filed under
 * the address the proxy will see as its peer. A state callback is asked
 * for so the entry goes away when the socket closes.
 */
static __always_inline void file_orig_dst(struct bpf_sock_ops *skops)
{
	struct orig_dst *od;
	struct orig_key key;
	struct bpf_sock *sk = skops->sk;

	if (!sk)
		return;
	od = bpf_sk_storage_get(&ae_sk_dst, sk, 0, 0);
	if (!od)
		return;
	if (orig_key_of_local(skops, &key))
		return;
	if (bpf_map_update_elem(&ae_orig_dst, &key, od, BPF_ANY) == 0)
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

static __always_inline void forget_orig_dst(struct bpf_sock_ops *skops)
{
	struct orig_key key;

	if (orig_key_of_local(skops, &key) == 0)
		bpf_map_delete_elem(&ae_orig_dst, &key);
}

/* sockops: TCP socket events below the node's cgroup root. */
SEC("sockops")
int ae_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		file_orig_dst(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == BPF_TCP_CLOSE)
			forget_orig_dst(skops);
		break;
	}
	return 1;
}

static __always_inline int orig_key_of_peer(struct bpf_sockopt *ctx, struct orig_key *key)
{
	struct bpf_sock *sk = ctx->sk;

	__builtin_memset(key, 0, sizeof(*key));
	if (!sk)
		return -1;
	key->netns_cookie = bpf_get_netns_cookie(ctx);
	if (sk->family == AF_INET) {
		addr_set_v4(&key->addr, sk->dst_ip4);
	} else if (sk->family == AF_INET6) {
		__u32 ip6[4] = {sk->dst_ip6[0], sk->dst_ip6[1], sk->dst_ip6[2], sk->dst_ip6[3]};

		addr_set_v6(&key->addr, ip6);
	} else {
		return -1;
	}
	key->port = (__be16)sk->dst_port;
	return 0;
}

/*
 * Answers SO_ORIGINAL_DST the way netfilter would have: a sockaddr_in for
 * SOL_IP when the original destination was IPv4, a sockaddr_in6 for
 * SOL_IPV6 when it was IPv6. Anything else keeps the kernel's own answer.
 */
static __always_inline void answer_orig_dst(struct bpf_sockopt *ctx)
{
	struct orig_key key;
	struct orig_dst *od;
	int len = 0;

	if (ctx->optname != SO_ORIGINAL_DST || (ctx->level != SOL_IP && ctx->level != SOL_IPV6))
		return;
	if (orig_key_of_peer(ctx, &key))
		return;
	od = bpf_map_lookup_elem(&ae_orig_dst, &key);
	if (!od)
		return;

	if (ctx->level == SOL_IP && od->family == AF_INET) {
		struct sockaddr_in_ *sa = ctx->optval;

		if ((void *)(sa + 1) > ctx->optval_end)
			return;
		__builtin_memset(sa, 0, sizeof(*sa));
		sa->family = AF_INET;
		sa->port = od->port;
		sa->addr = addr_words(&od->addr)[3];
		len = sizeof(*sa);
	} else if (ctx->level == SOL_IPV6 && od->family == AF_INET6) {
		struct sockaddr_in6_ *sa = ctx->optval;
		__u32 *w = addr_words(&od->addr);

		if ((void *)(sa + 1) > ctx->optval_end)
			return;
		__builtin_memset(sa, 0, sizeof(*sa));
		sa->family = AF_INET6;
		sa->port = od->port;
		sa->addr[0] = w[0];
		sa->addr[1] = w[1];
		sa->addr[2] = w[2];
		sa->addr[3] = w[3];
		len = sizeof(*sa);
	}
	if (len) {
		/* One store site for both: the verifier refuses context
		 * stores through a pointer the compiler offset itself. */
		ctx->optlen = len;
		ctx->retval = 0;
	}
}

/* cgroup/getsockopt: every getsockopt() below the node's cgroup root. */
SEC("cgroup/getsockopt")
int ae_getsockopt(struct bpf_sockopt *ctx)
{
	answer_orig_dst(ctx);
	/* Options longer than a page are only partly visible to BPF; an
	 * optlen of 0 tells older kernels to keep the kernel's own answer
	 * instead of failing the call with EFAULT. */
	if (ctx->optlen > PAGE_SIZE_)
		ctx->optlen = 0;
	return 1;
}
