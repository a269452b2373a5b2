// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Outbound capture with cgroup socket hooks, attached once to the node's
 * cgroup v2 root and scoped to enrolled pods by netns cookie.
 *
 *   connect4/6    R1: an enrolled pod's TCP connect goes to the pod's own
 *                 IP and ztunnel's :15001; R9: DNS (UDP, and TCP to :53)
 *                 goes to ztunnel's proxy on 127.0.0.1/::1 :15053. The
 *                 original destination stays with the socket.
 *   sendmsg4/6    R9 for unconnected UDP (sendto).
 *   recvmsg4/6    R9: replies from the proxy carry the queried address.
 *   getpeername4/6  a redirected socket still names its original peer.
 *   sockops       when a redirected socket starts connecting, file its
 *                 original destination under its local address (the peer
 *                 the proxy sees), and forget it at close; file a node
 *                 socket's flow to an enrolled pod (H1, direct mode, where
 *                 bpf/probe.c does not); close out host-probe entries with
 *                 their socket (H1).
 *   getsockopt    answer SO_ORIGINAL_DST for ztunnel's accepted sockets.
 *
 * No packet is rewritten and no conntrack entry is made: the connection
 * really is pod -> ztunnel, which is why ztunnel's own upstream DNS queries
 * can never be confused with the app's.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "lib.h"
#include "trace.h"
#include "sockaddr.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define SYS_PROCEED 1
#define SYS_REJECT  0

#define SOL_IP          0
#define SOL_IPV6        41
#define SO_ORIGINAL_DST 80 /* IPv4 SOL_IP and IP6T_SO_ORIGINAL_DST share the number */
#define IPPROTO_TCP_    6
#define IPPROTO_UDP_    17
#define PAGE_SIZE_      4096
#define DNS_PORT        53

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

/* The node's netns (its cookie): in direct mode its sockets' connections
 * to enrolled pods are host probes (H1). Written by the agent after load,
 * before the hooks are attached (where the kernel lacks SO_NETNS_COOKIE,
 * the cookie is read with a program of this object); a section of its own,
 * so the write is one map update. */
volatile __u64 ae_node_netns_cookie SEC(".data.node") = 0;

/*
 * Node sockets that connect to an enrolled pod, in direct mode: marked by
 * connect, where the socket's netns is known on every kernel (sockops
 * learns it only in 5.15), and filed by sockops once the source port is
 * chosen (file_direct_probe). Not pinned: a probe that connects while the
 * agent replaces its programs loses its mark and is captured, once.
 */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} ae_sk_probe SEC(".maps");

/*
 * The pod the socket's netns belongs to, or NULL when the socket is not
 * in an enrolled netns (R16): one hash lookup for everyone else. *cookie
 * is the socket's netns (0 without a socket).
 */
static __always_inline struct netns_info *pod_netns(struct bpf_sock_addr *ctx, __u64 *cookie)
{
	*cookie = 0;
	if (!ctx->sk)
		return NULL;
	*cookie = bpf_get_netns_cookie(ctx);
	return bpf_map_lookup_elem(&ae_netns, cookie);
}

/* Whether connect marks a socket of the netns of cookie as a possible host
 * probe: only the node's own sockets are, and sockops needs the mark in
 * the direct mode (to file the flow) and in the node-wide half of a split
 * attach (to know the socket is the node's at all). */
static __always_inline bool node_probe_netns(__u64 cookie, bool connect)
{
	/* Where bpf/probe.c files the direct mode's probes nothing is marked. */
	if ((ae_cfg.flags & AE_CFG_PROBE_CONNECT) || !connect || !cookie || cookie != ae_node_netns_cookie)
		return false;
	return ae_cfg.flags & (AE_CFG_PROBE_DIRECT | AE_CFG_NODE_SCOPE);
}

/*
 * H1 in direct mode: a node socket's TCP connect to an enrolled pod is a
 * host probe. The socket is marked for sockops, which files its flow
 * before the SYN leaves. Traffic the node forwards has no socket here and
 * a socket of any other netns is not the node's, so both stay captured
 * (H2), whatever source address they carry.
 */
static __always_inline void mark_node_probe(struct bpf_sock_addr *ctx, const struct ae_addr *dst)
{
	/* Loopback first: the node's own daemons talk over it most, and no
	 * pod has such an address; the hash lookup is the costly part. */
	if (ctx->protocol != IPPROTO_TCP_ || addr_is_loopback(dst) || !bpf_map_lookup_elem(&ae_pods, dst))
		return;
	bpf_sk_storage_get(&ae_sk_probe, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
}

/*
 * Decides what to do with a destination of an enrolled pod's socket (dst
 * is IPv4-mapped for IPv4), as a reason (enum ae_reason): AE_R_OUTBOUND
 * and AE_R_DNS capture, every other one passes. ztunnel's own sockets
 * (R2: mark 0x539), local destinations (loopback, the pod's own address:
 * traffic that leaves over lo) and the probe address are never captured
 * (R3, R4, R8).
 */
static __always_inline __u8 classify(struct bpf_sock_addr *ctx, struct netns_info *ns,
				     const struct ae_addr *dst, __be16 dport, bool v4)
{
	const struct ae_addr *probe = v4 ? (struct ae_addr *)&ae_cfg.probe_v4 : (struct ae_addr *)&ae_cfg.probe_v6;
	const struct ae_addr *self = v4 ? &ns->ip4 : &ns->ip6;
	bool dns_port = dport == bpf_htons(DNS_PORT);
	bool dns = dns_port && (ns->flags & AE_F_DNS_CAPTURE);

	if (mark_is_ztunnel(ctx->sk->mark))
		return AE_R_ZTUNNEL_MARK;
	if (addr_is_loopback(dst))
		return AE_R_LOOPBACK;
	if (addr_eq(dst, self))
		return AE_R_OWN_IP;
	if (ctx->protocol == IPPROTO_UDP_) {
		if (dns)
			return AE_R_DNS;
		return dns_port ? AE_R_DNS_CAPTURE_OFF : AE_R_UDP_NOT_DNS; /* R13, R11 */
	}
	if (ctx->protocol != IPPROTO_TCP_)
		return AE_R_NOT_TCP;
	if (addr_eq(dst, probe))
		return AE_R_PROBE_DEST;
	return dns ? AE_R_DNS : AE_R_OUTBOUND;
}

static __always_inline void count(struct netns_info *ns, __u8 reason)
{
	struct pod_stats *st = pod_stats(ns->slot);

	if (!st)
		return;
	if (reason == AE_R_DNS)
		st->dns_redirects++;
	else
		st->outbound_redirects++;
}

/*
 * The node-wide half of a split attach (AE_CFG_NODE_SCOPE): attached to the
 * cgroup root while the full set is on the cgroup that holds the pods, so
 * that the pods' sockets meet ours before any program at the root (a socket
 * load balancer, issue 35). Here only the node's own sockets matter: a TCP
 * connect to an enrolled pod is marked for sockops (host probes, H1). A
 * pod's socket costs one netns cookie read.
 */
static __always_inline int node_scope_connect(struct bpf_sock_addr *ctx, bool connect, bool v6)
{
	struct ae_addr dst;
	__u32 ip6[4];

	if (ctx->protocol != IPPROTO_TCP_ || !ctx->sk || !node_probe_netns(bpf_get_netns_cookie(ctx), connect))
		return SYS_PROCEED;
	if (v6) {
		ip6[0] = ctx->user_ip6[0];
		ip6[1] = ctx->user_ip6[1];
		ip6[2] = ctx->user_ip6[2];
		ip6[3] = ctx->user_ip6[3];
		addr_set_v6(&dst, ip6);
	} else {
		addr_set_v4(&dst, ctx->user_ip4);
	}
	mark_node_probe(ctx, &dst);
	return SYS_PROCEED;
}

/*
 * Keeps the original destination with the socket. Failing to keep it
 * fails the call: a redirected connection whose destination ztunnel
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

/*
 * DNS goes to ztunnel's proxy on loopback, but from the pod's own address,
 * as with iptables' REDIRECT (which rewrites only the destination): the
 * proxy sees the same client either way. connect() binds the socket (port
 * left to the kernel; a socket the app bound already keeps its address),
 * sendto() sets the datagram's source.
 */
static __always_inline void dns_source4(struct bpf_sock_addr *ctx, struct netns_info *ns, bool connect)
{
	struct sockaddr_in_ sa = {.family = AF_INET};

	if (!(ns->flags & AE_F_HAS_V4))
		return;
	sa.addr = addr_words(&ns->ip4)[3];
	if (connect)
		bpf_bind(ctx, (struct sockaddr *)&sa, sizeof(sa));
	else
		ctx->msg_src_ip4 = sa.addr;
}

static __always_inline void dns_source6(struct bpf_sock_addr *ctx, struct netns_info *ns, bool v4, bool connect)
{
	struct sockaddr_in6_ sa = {.family = AF_INET6};
	__u32 *w;

	if (!(ns->flags & (v4 ? AE_F_HAS_V4 : AE_F_HAS_V6)))
		return;
	w = addr_words(v4 ? &ns->ip4 : &ns->ip6);
	sa.addr[0] = w[0];
	sa.addr[1] = w[1];
	sa.addr[2] = w[2];
	sa.addr[3] = w[3];
	if (connect) {
		bpf_bind(ctx, (struct sockaddr *)&sa, sizeof(sa));
	} else {
		ctx->msg_src_ip6[0] = sa.addr[0];
		ctx->msg_src_ip6[1] = sa.addr[1];
		ctx->msg_src_ip6[2] = sa.addr[2];
		ctx->msg_src_ip6[3] = sa.addr[3];
	}
}

/*
 * The event of a socket hook's decision: the socket's source as far as it
 * is bound, the destination it asked for, where it was sent (captured).
 * Called only while tracing.
 */
static __always_inline void trace_sock(struct bpf_sock_addr *ctx, __u8 hook, __u8 reason, const struct netns_info *ns,
				       const struct ae_addr *dst, __be16 dport, const struct ae_addr *to, __be16 to_port)
{
	struct ae_event *e = trace_reserve(hook, reason);
	struct bpf_sock *sk = ctx->sk;

	if (!e)
		return;
	e->netns_cookie = bpf_get_netns_cookie(ctx);
	if (ns)
		e->slot = ns->slot;
	if (sk) {
		sock_local(sk, &e->saddr);
		e->sport = bpf_htons((__u16)sk->src_port);
	}
	e->daddr = *dst;
	e->dport = dport;
	if (to) {
		e->to = *to;
		e->to_port = to_port;
	}
	e->proto = ctx->protocol;
	trace_submit(e);
}

/* R1/R9 for an IPv4 destination (connect4 and sendmsg4). */
static __always_inline int redirect4(struct bpf_sock_addr *ctx, bool connect)
{
	__u8 hook = connect ? AE_HOOK_CONNECT4 : AE_HOOK_SENDMSG4;
	struct ae_addr dst, to;
	struct netns_info *ns;
	__u64 cookie;
	__be16 dport;
	__u8 reason;

	if (ae_cfg.flags & AE_CFG_NODE_SCOPE)
		return node_scope_connect(ctx, connect, false);
	ns = pod_netns(ctx, &cookie);
	if (!ns) {
		bool probe = node_probe_netns(cookie, connect);

		if (probe || ae_tracing)
			addr_set_v4(&dst, ctx->user_ip4);
		if (probe)
			mark_node_probe(ctx, &dst);
		if (ae_tracing)
			trace_sock(ctx, hook, AE_R_NOT_ENROLLED, NULL, &dst, (__be16)ctx->user_port, NULL, 0);
		return SYS_PROCEED;
	}
	/* Read once, kept in a register: the verifier refuses a context
	 * load through a pointer clang offset itself. */
	dport = (__be16)ctx->user_port;
	barrier_var(dport);
	addr_set_v4(&dst, ctx->user_ip4);
	reason = classify(ctx, ns, &dst, dport, true);
	if (reason != AE_R_OUTBOUND && reason != AE_R_DNS) {
		count_decision(reason);
		if (ae_tracing)
			trace_sock(ctx, hook, reason, ns, &dst, dport, NULL, 0);
		return SYS_PROCEED;
	}
	if (remember_orig_dst(ctx, ns, &dst, AF_INET)) {
		count_decision(AE_R_ORIG_DST_ERROR);
		if (ae_tracing)
			trace_sock(ctx, hook, AE_R_ORIG_DST_ERROR, ns, &dst, dport, NULL, 0);
		return SYS_REJECT;
	}
	if (reason == AE_R_DNS) {
		dns_source4(ctx, ns, connect);
		ctx->user_ip4 = bpf_htonl(0x7f000001);
		ctx->user_port = bpf_htons(ae_cfg.dns_port);
	} else {
		/* The pod's own address (not 127.0.0.1) makes the kernel pick
		 * it as source, so ztunnel sees the same peer as with iptables'
		 * REDIRECT. A pod without IPv4 falls back to loopback. */
		ctx->user_ip4 = (ns->flags & AE_F_HAS_V4) ? addr_words(&ns->ip4)[3] : bpf_htonl(0x7f000001);
		ctx->user_port = bpf_htons(ae_cfg.outbound_port);
	}
	count(ns, reason);
	count_decision(reason);
	if (ae_tracing) {
		addr_set_v4(&to, ctx->user_ip4);
		trace_sock(ctx, hook, reason, ns, &dst, dport, &to, (__be16)ctx->user_port);
	}
	return SYS_PROCEED;
}

static __always_inline void set_user_ip6(struct bpf_sock_addr *ctx, __u32 w0, __u32 w1, __u32 w2, __u32 w3)
{
	ctx->user_ip6[0] = w0;
	ctx->user_ip6[1] = w1;
	ctx->user_ip6[2] = w2;
	ctx->user_ip6[3] = w3;
}

/*
 * R1/R9/R15 for IPv6 sockets (connect6 and sendmsg6). Dual-stack clients
 * (Java, for one) reach IPv4 peers through IPv4-mapped addresses; the
 * kernel then talks IPv4 without running connect4, so the mapped case is
 * handled here as IPv4.
 */
static __always_inline int redirect6(struct bpf_sock_addr *ctx, bool connect)
{
	__u8 hook = connect ? AE_HOOK_CONNECT6 : AE_HOOK_SENDMSG6;
	struct ae_addr dst, to;
	struct netns_info *ns;
	__u64 cookie;
	__be16 dport;
	__u32 ip6[4];
	__u8 reason;
	bool v4;

	if (ae_cfg.flags & AE_CFG_NODE_SCOPE)
		return node_scope_connect(ctx, connect, true);
	ns = pod_netns(ctx, &cookie);
	if (!ns && !ae_tracing && !node_probe_netns(cookie, connect))
		return SYS_PROCEED;
	dport = (__be16)ctx->user_port;
	barrier_var(dport); /* see redirect4 */
	ip6[0] = ctx->user_ip6[0];
	ip6[1] = ctx->user_ip6[1];
	ip6[2] = ctx->user_ip6[2];
	ip6[3] = ctx->user_ip6[3];
	addr_set_v6(&dst, ip6);
	if (!ns) {
		if (node_probe_netns(cookie, connect))
			mark_node_probe(ctx, &dst);
		if (ae_tracing)
			trace_sock(ctx, hook, AE_R_NOT_ENROLLED, NULL, &dst, dport, NULL, 0);
		return SYS_PROCEED;
	}
	v4 = ip6_is_v4_mapped(ip6);
	reason = classify(ctx, ns, &dst, dport, v4);
	if (reason != AE_R_OUTBOUND && reason != AE_R_DNS) {
		count_decision(reason);
		if (ae_tracing)
			trace_sock(ctx, hook, reason, ns, &dst, dport, NULL, 0);
		return SYS_PROCEED;
	}
	if (remember_orig_dst(ctx, ns, &dst, v4 ? AF_INET : AF_INET6)) {
		count_decision(AE_R_ORIG_DST_ERROR);
		if (ae_tracing)
			trace_sock(ctx, hook, AE_R_ORIG_DST_ERROR, ns, &dst, dport, NULL, 0);
		return SYS_REJECT;
	}
	if (reason == AE_R_DNS)
		dns_source6(ctx, ns, v4, connect);

	if (v4 && (reason == AE_R_DNS || !(ns->flags & AE_F_HAS_V4))) {
		addr_set_v4(&to, bpf_htonl(0x7f000001));
	} else if (!v4 && (reason == AE_R_DNS || !(ns->flags & AE_F_HAS_V6))) {
		__u32 lo6[4] = {0, 0, 0, bpf_htonl(1)};

		addr_set_v6(&to, lo6);
	} else {
		to = v4 ? ns->ip4 : ns->ip6;
	}
	set_user_ip6(ctx, addr_words(&to)[0], addr_words(&to)[1], addr_words(&to)[2], addr_words(&to)[3]);
	ctx->user_port = bpf_htons(reason == AE_R_DNS ? ae_cfg.dns_port : ae_cfg.outbound_port);
	count(ns, reason);
	count_decision(reason);
	if (ae_tracing)
		trace_sock(ctx, hook, reason, ns, &dst, dport, &to, (__be16)ctx->user_port);
	return SYS_PROCEED;
}

/* The original destination of a redirected socket, for reverse paths. */
static __always_inline struct orig_dst *redirected(struct bpf_sock_addr *ctx)
{
	if (!ctx->sk)
		return NULL;
	return bpf_sk_storage_get(&ae_sk_dst, ctx->sk, 0, 0);
}

/*
 * Gives back the address the app asked for, where the kernel would show
 * ztunnel's: the source of DNS replies (recvmsg), the peer of a connected
 * socket (getpeername). Only sockets we redirected carry storage.
 */
static __always_inline void restore4(struct bpf_sock_addr *ctx, bool only_dns_proxy)
{
	struct orig_dst *od = redirected(ctx);

	if (!od || od->family != AF_INET)
		return;
	if (only_dns_proxy && (ctx->user_ip4 != bpf_htonl(0x7f000001) || ctx->user_port != bpf_htons(ae_cfg.dns_port)))
		return;
	ctx->user_ip4 = addr_words(&od->addr)[3];
	ctx->user_port = od->port;
}

static __always_inline void restore6(struct bpf_sock_addr *ctx, bool only_dns_proxy)
{
	struct orig_dst *od = redirected(ctx);
	__u32 *w;

	if (!od)
		return;
	if (only_dns_proxy && ctx->user_port != bpf_htons(ae_cfg.dns_port))
		return;
	w = addr_words(&od->addr);
	set_user_ip6(ctx, w[0], w[1], w[2], w[3]);
	ctx->user_port = od->port;
}

/* cgroup/connect4: every IPv4 connect() below the node's cgroup root. */
SEC("cgroup/connect4")
int ae_connect4(struct bpf_sock_addr *ctx)
{
	return redirect4(ctx, true);
}

/* cgroup/connect6: every IPv6 connect(), IPv4-mapped included. */
SEC("cgroup/connect6")
int ae_connect6(struct bpf_sock_addr *ctx)
{
	return redirect6(ctx, true);
}

/* cgroup/sendmsg4: UDP sendto() with a destination. */
SEC("cgroup/sendmsg4")
int ae_sendmsg4(struct bpf_sock_addr *ctx)
{
	return redirect4(ctx, false);
}

/* cgroup/sendmsg6: UDP sendto() on IPv6 sockets. */
SEC("cgroup/sendmsg6")
int ae_sendmsg6(struct bpf_sock_addr *ctx)
{
	return redirect6(ctx, false);
}

/* cgroup/recvmsg4: UDP recvfrom() source addresses. */
SEC("cgroup/recvmsg4")
int ae_recvmsg4(struct bpf_sock_addr *ctx)
{
	restore4(ctx, true);
	return SYS_PROCEED;
}

/* cgroup/recvmsg6: UDP recvfrom() source addresses on IPv6 sockets. */
SEC("cgroup/recvmsg6")
int ae_recvmsg6(struct bpf_sock_addr *ctx)
{
	restore6(ctx, true);
	return SYS_PROCEED;
}

/* cgroup/getpeername4: the peer a connected socket reports. */
SEC("cgroup/getpeername4")
int ae_getpeername4(struct bpf_sock_addr *ctx)
{
	restore4(ctx, false);
	return SYS_PROCEED;
}

/* cgroup/getpeername6: the peer a connected IPv6 socket reports. */
SEC("cgroup/getpeername6")
int ae_getpeername6(struct bpf_sock_addr *ctx)
{
	restore6(ctx, false);
	return SYS_PROCEED;
}

/*
 * bpf_get_netns_cookie() reached sockops and sockopt programs in Linux
 * 5.15. Before that, ae_orig_dst entries are scoped by the client's address
 * alone (netns cookie 0): pod IPs are unique on a node, so only a client
 * redirected from loopback (a pod without an address of the destination's
 * family) could meet another pod's. The branch not taken is dead code the
 * verifier never checks, so older kernels never see the helper. Both
 * sides must agree, so both follow the sockopt flag's answer.
 */
static __always_inline __u64 sockops_netns_cookie(struct bpf_sock_ops *skops)
{
	if ((ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS) && (ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPT))
		return bpf_get_netns_cookie(skops);
	return 0;
}

static __always_inline __u64 sockopt_netns_cookie(struct bpf_sockopt *ctx)
{
	if ((ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS) && (ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPT))
		return bpf_get_netns_cookie(ctx);
	return 0;
}

/*
 * Whether ztunnel's socket is in an enrolled pod. Without netns cookies
 * (before 5.15) every ztunnel socket counts: the answer is then the
 * socket's own local address, which ztunnel falls back to anyway.
 */
static __always_inline bool netns_enrolled(__u64 cookie)
{
	if (!(ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPT))
		return true;
	return bpf_map_lookup_elem(&ae_netns, &cookie) != NULL;
}

static __always_inline void orig_key_of_local(struct bpf_sock_ops *skops, struct orig_key *key)
{
	__builtin_memset(key, 0, sizeof(*key));
	key->netns_cookie = sockops_netns_cookie(skops);
	sockops_local(skops, &key->addr);
	/* sockops gives the local port in host byte order. */
	key->port = bpf_htons((__u16)skops->local_port);
}

/* The host-probe translation a node socket connected to a pod may own. */
static __always_inline void probe_key_of(struct bpf_sock_ops *skops, struct probe_key *key)
{
	__builtin_memset(key, 0, sizeof(*key));
	sockops_remote(skops, &key->pod);
	/* On little-endian hosts the kernel hands sockops the network-order
	 * remote port in the upper 16 bits of remote_port. */
	key->pod_port = (__be16)(skops->remote_port >> 16);
	key->host_port = bpf_htons((__u16)skops->local_port);
}

/* The flow of a connecting socket as the peer's sk_lookup will see it. */
static __always_inline void local_flow_key(struct bpf_sock_ops *skops, struct steer_key *key)
{
	__builtin_memset(key, 0, sizeof(*key));
	sockops_local(skops, &key->saddr);
	sockops_remote(skops, &key->daddr);
	key->sport = bpf_htons((__u16)skops->local_port);
	key->dport = (__be16)(skops->remote_port >> 16);
}

/*
 * The event of a table that ran full as a socket connected: its local
 * address and port, and dst (the original destination, or the app it
 * connects to). Called only while tracing.
 */
static __always_inline void trace_sockops(struct bpf_sock_ops *skops, __u8 reason, __u32 slot,
					  const struct ae_addr *dst, __be16 dport)
{
	struct ae_event *e = trace_reserve(AE_HOOK_SOCKOPS, reason);

	if (!e)
		return;
	e->netns_cookie = sockops_netns_cookie(skops);
	e->slot = slot;
	sockops_local(skops, &e->saddr);
	e->sport = bpf_htons((__u16)skops->local_port);
	e->daddr = *dst;
	e->dport = dport;
	e->proto = IPPROTO_TCP_;
	trace_submit(e);
}

/*
 * R10: ztunnel connects to the app of the pod whose netns it is in. The
 * pod's sk_lookup program must leave this SYN to the app (see
 * ae_local_flows). Only where sk_lookup captures inbound (the flag implies
 * netns cookies in sockops).
 */
static __always_inline bool file_local_flow(struct bpf_sock_ops *skops, const struct pod_info *pod,
					    const struct ae_addr *remote)
{
	struct steer_key key;
	__u32 one = 1;

	if (pod->netns_cookie != bpf_get_netns_cookie(skops))
		return false;
	local_flow_key(skops, &key);
	if (bpf_map_update_elem(&ae_local_flows, &key, &one, BPF_ANY)) {
		struct pod_stats *st = pod_stats(pod->slot);

		if (st)
			st->orig_dst_errors++;
		count_decision(AE_R_LOCAL_FLOW_FULL);
		if (ae_tracing)
			trace_sockops(skops, AE_R_LOCAL_FLOW_FULL, pod->slot, &key.daddr, key.dport);
		return false;
	}
	return true;
}

/*
 * H1 in direct mode: a node socket that connect marked (mark_node_probe)
 * files its flow, as the pod will see it, with its own address: the pod's
 * programs let exactly this flow reach the app (node_probe in bpf/tc.c).
 * An entry of the same flow from a closed socket of the same address is
 * taken over; one of another address is left alone, and this probe is
 * captured like any other inbound flow.
 */
static __always_inline bool file_direct_probe(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct pod_info *pod)
{
	struct probe_nat nat = {}, *old;
	struct pod_stats *st;
	struct probe_key key;

	if (!bpf_sk_storage_get(&ae_sk_probe, sk, 0, 0))
		return false;
	probe_key_of(skops, &key);
	sockops_local(skops, &nat.host);
	nat.last_seen_ns = bpf_ktime_get_ns();
	if (bpf_map_update_elem(&ae_probe_nat, &key, &nat, BPF_NOEXIST)) {
		old = bpf_map_lookup_elem(&ae_probe_nat, &key);
		if (!old || !addr_eq(&old->host, &nat.host)) {
			count_decision(old ? AE_R_PROBE_PORT_TAKEN : AE_R_PROBE_TABLE_FULL);
			if (ae_tracing)
				trace_sockops(skops, old ? AE_R_PROBE_PORT_TAKEN : AE_R_PROBE_TABLE_FULL, pod->slot, &key.pod, key.pod_port);
			return false;
		}
		old->last_seen_ns = nat.last_seen_ns;
	}
	st = pod_stats(pod->slot);
	if (st)
		st->probe_snat++;
	return true;
}

/*
 * Whether a socket connecting to an enrolled pod needs its close seen, so
 * that an entry keyed by its flow goes with it: ztunnel's delivery to the
 * app of its own pod (R10, filed here where sk_lookup captures inbound;
 * without it the pod's lo program may file one), and a host probe of the
 * node's netns (H1: filed here in direct mode, by the SYN leaving the node
 * in snat mode). Every state change of a tracked socket runs this program
 * again (five or six per connection), so the pods' own connections to
 * other pods, and ztunnel's to other pods, which neither mode files, are
 * not tracked where the netns can be told apart.
 */
static __always_inline bool track_pod_flow(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct pod_info *pod,
					   const struct ae_addr *remote)
{
	bool cookies = (ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS) && (ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPT);

	if (mark_is_ztunnel(sk->mark)) {
		if ((ae_cfg.flags & AE_CFG_SK_LOOKUP_IFINDEX) && (ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS))
			return file_local_flow(skops, pod, remote);
		return true;
	}
	if (ae_cfg.flags & AE_CFG_PROBE_DIRECT)
		return file_direct_probe(skops, sk, pod);
	return !cookies || bpf_get_netns_cookie(skops) == ae_node_netns_cookie;
}

/*
 * A socket starts connecting (TCP_CONNECT_CB runs just before the SYN).
 * A redirected one files its original destination under the address the
 * proxy will see as its peer; one connecting to an enrolled pod may file
 * its flow (track_pod_flow). Either way a state callback is asked for, so
 * the entry goes away exactly when the socket closes.
 */
static __always_inline void on_connect(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct orig_key key;
	struct ae_addr remote;
	struct orig_dst *od;
	struct pod_info *pod;
	bool track = false;

	if (!sk)
		return;
	od = bpf_sk_storage_get(&ae_sk_dst, sk, 0, 0);
	if (od) {
		orig_key_of_local(skops, &key);
		track = bpf_map_update_elem(&ae_orig_dst, &key, od, BPF_ANY) == 0;
		if (!track) {
			/* ztunnel will read the redirected address instead. */
			count_decision(AE_R_ORIG_DST_FULL);
			if (ae_tracing)
				trace_sockops(skops, AE_R_ORIG_DST_FULL, AE_NO_SLOT, &od->addr, od->port);
		}
	} else {
		sockops_remote(skops, &remote);
		pod = bpf_map_lookup_elem(&ae_pods, &remote);
		track = pod && track_pod_flow(skops, sk, pod, &remote);
	}
	if (track)
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/*
 * The socket that filed an entry is the only one that removes it: another
 * socket of the netns may hold the same local address and port towards a
 * different peer (ztunnel's upstream connection, for one), and its close
 * must not take a live redirected connection's original destination.
 */
static __always_inline void on_close(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct orig_key key;
	struct probe_key pk;
	struct probe_nat *nat;
	struct ae_addr local;

	if (!sk)
		return;
	if (bpf_sk_storage_get(&ae_sk_dst, sk, 0, 0)) {
		orig_key_of_local(skops, &key);
		bpf_map_delete_elem(&ae_orig_dst, &key);
		return;
	}
	if (mark_is_ztunnel(sk->mark)) {
		struct steer_key fk;

		local_flow_key(skops, &fk);
		bpf_map_delete_elem(&ae_local_flows, &fk);
		return;
	}
	probe_key_of(skops, &pk);
	nat = bpf_map_lookup_elem(&ae_probe_nat, &pk);
	sockops_local(skops, &local);
	if (nat && addr_eq(&nat->host, &local))
		bpf_map_delete_elem(&ae_probe_nat, &pk);
}

/*
 * R5: ztunnel's inbound listener starts listening in a pod netns. It is
 * filed, by netns, for the pod's sk_lookup program, which hands new
 * inbound flows to it. Only ztunnel's (marked) sockets count, so an app
 * that listens on the same port never receives captured traffic. Only an
 * enrolled pod's netns counts: ae_listeners is shared by the node, and
 * anyone who can make a user namespace holds CAP_NET_ADMIN over a netns
 * of their own, and so can set the mark and listen there; filed, such
 * listeners would take every slot and leave the next pods' ztunnel
 * listeners out (their inbound refused). An enrolled netns has
 * AE_LISTENER_SLOTS keys, so no pod takes more than its share. A
 * listener that started before its pod's ae_netns entry existed is filed
 * by the enrolment (the iterator in bpf/listeners.c runs after the entry
 * is written) or by the agent's resync. The entry lives exactly as long
 * as the socket (the kernel drops a closed socket from the map). Several
 * may exist (a ztunnel rollout): each takes a free slot, and since they
 * share one reuseport group, any one of them reaches all.
 */
static __always_inline void on_listen(struct bpf_sock_ops *skops)
{
	struct listener_key key = {};
	struct bpf_sock *sk = skops->sk;
	struct netns_info *ns;
	__u16 i;

	/* Netns cookies in sockops (5.15) come with sk_lookup's ingress
	 * interface (5.17); without them inbound goes through tc. */
	if (!sk || !(ae_cfg.flags & AE_CFG_SK_LOOKUP_IFINDEX) || !(ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS))
		return;
	if (skops->local_port != ae_cfg.inbound_port || !mark_is_ztunnel(sk->mark))
		return;
	key.netns_cookie = bpf_get_netns_cookie(skops);
	ns = bpf_map_lookup_elem(&ae_netns, &key.netns_cookie);
	if (!ns)
		return;
	key.port = ae_cfg.inbound_port;
	for (i = 0; i < AE_LISTENER_SLOTS; i++) {
		key.idx = i;
		if (bpf_sock_hash_update(skops, &ae_listeners, &key, BPF_NOEXIST) == 0)
			return;
	}
	/* Every slot taken by live listeners: the newest replaces slot 0. */
	key.idx = 0;
	if (bpf_sock_hash_update(skops, &ae_listeners, &key, BPF_ANY) == 0)
		return;
	/* The map is full: the agent's resync files it when room returns. */
	count_decision(AE_R_LISTENER_FULL);
	if (ae_tracing) {
		struct ae_addr none = {};

		trace_sockops(skops, AE_R_LISTENER_FULL, ns->slot, &none, 0);
	}
}

/*
 * ztunnel's connection to the app of its pod is established. One that
 * connected before the pod was enrolled was filed in ae_local_flows by the
 * pod's lo program (file_overtaken_delivery in bpf/tc.c), not by
 * on_connect, and so has no state callback yet: ask for it now, so that
 * on_close removes the entry with the socket. Every other socket returns
 * at the mark or the flag test.
 */
static __always_inline void on_active_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct steer_key key;

	if (!sk || !mark_is_ztunnel(sk->mark) || (skops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_STATE_CB_FLAG))
		return;
	if (!(ae_cfg.flags & AE_CFG_SK_LOOKUP_IFINDEX) || !(ae_cfg.flags & AE_CFG_NETNS_COOKIE_SOCKOPS))
		return;
	local_flow_key(skops, &key);
	if (bpf_map_lookup_elem(&ae_local_flows, &key))
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/* sockops: TCP socket events below the node's cgroup root. */
SEC("sockops")
int ae_sockops(struct bpf_sock_ops *skops)
{
	/* The node-wide half of a split attach: only the node's sockets
	 * connect marked (node_scope_connect), and only their connect and
	 * state callbacks matter; the pods' cgroup runs the full program for
	 * everyone else. Every pod socket's callbacks meet this program too,
	 * so the op is tested before the socket's storage is looked up. */
	if (ae_cfg.flags & AE_CFG_NODE_SCOPE) {
		struct bpf_sock *sk = skops->sk;

		if (skops->op != BPF_SOCK_OPS_TCP_CONNECT_CB && skops->op != BPF_SOCK_OPS_STATE_CB)
			return 1;
		if (!sk || !bpf_sk_storage_get(&ae_sk_probe, sk, 0, 0))
			return 1;
	}
	switch (skops->op) {
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		on_connect(skops);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		on_active_established(skops);
		break;
	case BPF_SOCK_OPS_TCP_LISTEN_CB:
		on_listen(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == BPF_TCP_CLOSE)
			on_close(skops);
		break;
	}
	return 1;
}

/*
 * The original destination of ztunnel's accepted socket: filed by the
 * client's sockops for outbound captures (R1); for flows handed over by
 * bpf_sk_assign (R5, R14) it is the socket's own local address, since no
 * address was rewritten. Only ztunnel's sockets (mark 0x539) in enrolled
 * netns get the second answer; anyone else keeps the kernel's.
 */
static __always_inline bool lookup_orig_dst(struct bpf_sockopt *ctx, struct orig_dst *out)
{
	struct bpf_sock *sk = ctx->sk;
	struct orig_key key = {};
	struct orig_dst *od;
	__u64 cookie;

	if (!sk || (sk->family != AF_INET && sk->family != AF_INET6))
		return false;
	sock_remote(sk, &key.addr);
	key.port = (__be16)sk->dst_port;
	cookie = sockopt_netns_cookie(ctx);
	key.netns_cookie = cookie;
	od = bpf_map_lookup_elem(&ae_orig_dst, &key);
	if (od) {
		*out = *od;
		/* Written once, not on every read: the entry stays clean in
		 * the other CPUs' caches. */
		if (!od->pad)
			od->pad = 1; /* read: see struct orig_dst */
		return true;
	}
	if (!mark_is_ztunnel(sk->mark) || !netns_enrolled(cookie))
		return false;
	/* bpf_sock.src_port is in host byte order. */
	if (sk->src_port == ae_cfg.outbound_port || sk->src_port == ae_cfg.inbound_port ||
	    sk->src_port == ae_cfg.hbone_port || sk->src_port == ae_cfg.dns_port)
		return false;
	sock_local(sk, &out->addr);
	out->port = bpf_htons((__u16)sk->src_port);
	out->family = ip6_is_v4_mapped((__u32 *)out->addr.b) ? AF_INET : AF_INET6;
	return true;
}

/*
 * Answers SO_ORIGINAL_DST the way netfilter would have: a sockaddr_in for
 * SOL_IP when the original destination was IPv4, a sockaddr_in6 for
 * SOL_IPV6 when it was IPv6. Anything else keeps the kernel's own answer.
 */
static __always_inline void answer_orig_dst(struct bpf_sockopt *ctx)
{
	struct orig_dst od = {};
	int len = 0;

	if (ctx->optname != SO_ORIGINAL_DST || (ctx->level != SOL_IP && ctx->level != SOL_IPV6))
		return;
	if (!lookup_orig_dst(ctx, &od))
		return;

	if (ctx->level == SOL_IP && od.family == AF_INET) {
		struct sockaddr_in_ *sa = ctx->optval;

		if ((void *)(sa + 1) > ctx->optval_end)
			return;
		__builtin_memset(sa, 0, sizeof(*sa));
		sa->family = AF_INET;
		sa->port = od.port;
		sa->addr = addr_words(&od.addr)[3];
		len = sizeof(*sa);
	} else if (ctx->level == SOL_IPV6 && od.family == AF_INET6) {
		struct sockaddr_in6_ *sa = ctx->optval;
		__u32 *w = addr_words(&od.addr);

		if ((void *)(sa + 1) > ctx->optval_end)
			return;
		__builtin_memset(sa, 0, sizeof(*sa));
		sa->family = AF_INET6;
		sa->port = od.port;
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

/*
 * Linux before 5.14 has no SO_NETNS_COOKIE, and before 5.12 a netns gets
 * its cookie only when a BPF program first asks. The agent learns a pod's
 * cookie there by binding a socket it made in the pod's netns and marked
 * with an ae_nsq entry; this hook (attached to the agent's own cgroup, only
 * on such kernels) writes the cookie into that entry.
 */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u64);
} ae_nsq SEC(".maps");

/* cgroup/bind4: the agent's netns cookie query (see ae_nsq). */
SEC("cgroup/bind4")
int ae_netns_query(struct bpf_sock_addr *ctx)
{
	__u64 *cookie;

	if (!ctx->sk)
		return SYS_PROCEED;
	cookie = bpf_sk_storage_get(&ae_nsq, ctx->sk, 0, 0);
	if (cookie)
		*cookie = bpf_get_netns_cookie(ctx);
	return SYS_PROCEED;
}
