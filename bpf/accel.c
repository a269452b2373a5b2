// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Sockmap acceleration of the pod-local hop between an app and ztunnel,
 * loaded only when the agent is asked for it (--sockmap-accel) and the
 * kernel has what it needs (Linux 5.15: netns cookies in sockops and
 * sk_msg programs).
 *
 * Both ends of the hop are sockets in the pod's netns: the app's socket
 * and the one ztunnel accepted on :15001 (R1), or ztunnel's delivery
 * socket and the one the app accepted (R10). A send on an end in ae_accel
 * whose peer is in ae_accel_rx is queued straight onto the peer's receive
 * queue (bpf_msg_redirect_hash with BPF_F_INGRESS): no segments, no
 * loopback softirq, no TCP for those bytes. The handshake, FIN and RST
 * still travel as TCP, so connect, accept, shutdown and close mean what
 * they always mean, and SO_ORIGINAL_DST, answered from ae_orig_dst, is
 * unaffected.
 *
 * Only a receiver that reads with recv/read sees redirected bytes: they
 * sit on the socket's BPF queue, which splice(2) (Go's io.Copy between
 * two TCP connections, HAProxy's splicing) and FIONREAD do not look at.
 * ztunnel reads with recv. So by default only the app's sends into
 * ztunnel skip TCP (ztunnel's ends are receivers only, in ae_accel_rx);
 * accel_into_app also redirects ztunnel's sends into the app.
 *
 *   sockops  each end goes into its maps as it is established
 *            (ACTIVE_/PASSIVE_ESTABLISHED), before connect() or accept()
 *            returns it: the app's connection to :15001 and the socket
 *            ztunnel accepts for it; ztunnel's delivery to the app and the
 *            socket the app accepts (it carries the return mark 0x111 of
 *            the SYN, R10). ztunnel needs no change. The connecting end
 *            files the connection in ae_accel_pair; the accepting end joins
 *            only if the sequence numbers prove it is the other end of that
 *            connection, and the two then know each other by socket cookie.
 *            The sockhashes are keyed by socket cookie, never by 4-tuple: a
 *            socket stays in them until its owner closes it, and by then a
 *            new connection may have the 4-tuple of its dead one.
 *   sk_msg   each send on an end in ae_accel: redirect, or let TCP carry it.
 *
 * The bytes of one direction must never take both ways: a receiver reads
 * what was redirected to it before what TCP queued, so data sent over TCP
 * first would be overtaken. Each sending end therefore decides once, at
 * its first send, and keeps to it (ae_accel_sk): redirect if its peer is
 * known and in ae_accel_rx then, TCP for good otherwise. Nothing goes through TCP
 * before that first send (a socket that carried data before it was
 * established, TCP Fast Open, is never put in), so the two ways never mix.
 * The connecting end may send before its peer exists (the handshake's
 * last ACK still in flight): that direction then stays on TCP.
 *
 * Anything the kernel refuses (an MPTCP subflow, a socket with a ULP, a
 * full table) stays on TCP, as does a hop whose other end is missing.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "lib.h"
#include "sockaddr.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* Ends whose sends are redirected, by socket cookie; the sk_msg program is
 * attached here. The kernel drops a socket from both sockhashes when its
 * owner closes it. Sized like ae_orig_dst. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1 << 18);
	__type(key, __u64);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_accel SEC(".maps");

/* Ends that receive redirected sends, by socket cookie (no program: their
 * own sends are TCP unless they are in ae_accel too). */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1 << 18);
	__type(key, __u64);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_accel_rx SEC(".maps");

/* Connections whose connecting end is in, until it closes (struct
 * accel_pair; not LRU: a live entry is never evicted). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 18);
	__type(key, struct accel_key);
	__type(value, struct accel_pair);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_accel_pair SEC(".maps");

/*
 * Set by the agent before load: ztunnel's sends into the app skip TCP too
 * (--sockmap-accel=both). Off, apps receive everything over TCP and may
 * read however they like.
 */
const volatile __u32 accel_into_app = 0;

/* Each end's state (struct accel_sock), freed with the socket. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct accel_sock);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_accel_sk SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct accel_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} ae_accel_stats SEC(".maps");

static __always_inline struct accel_stats *stats_slot(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&ae_accel_stats, &zero);
}

/* The connection as the socket sees it, or (reversed) as its peer does. */
static __always_inline void sockops_key(struct bpf_sock_ops *skops, __u64 cookie, bool reversed, struct accel_key *k)
{
	struct ae_addr local, remote;
	__be16 lport = bpf_htons((__u16)skops->local_port);
	/* Network order in the upper half on little-endian hosts (sock.c). */
	__be16 rport = (__be16)(skops->remote_port >> 16);

	__builtin_memset(k, 0, sizeof(*k));
	k->netns_cookie = cookie;
	sockops_local(skops, &local);
	sockops_remote(skops, &remote);
	k->local = reversed ? remote : local;
	k->remote = reversed ? local : remote;
	k->local_port = reversed ? rport : lport;
	k->remote_port = reversed ? lport : rport;
}

static __always_inline bool is_ztunnel_port(__u16 port)
{
	return port == ae_cfg.outbound_port || port == ae_cfg.inbound_port || port == ae_cfg.hbone_port ||
	       port == ae_cfg.dns_port;
}

static __always_inline bool is_pod_addr(struct netns_info *ns, const struct ae_addr *a)
{
	return ((ns->flags & AE_F_HAS_V4) && addr_eq(a, &ns->ip4)) || ((ns->flags & AE_F_HAS_V6) && addr_eq(a, &ns->ip6));
}

/* Which end of a hop a socket is (hop_end). */
#define END_NONE    0
#define END_APP     1 /* the app's socket: it sends into ztunnel */
#define END_ZTUNNEL 2 /* ztunnel's socket: it receives the app's sends */

/*
 * Which end of a hop an established socket of an enrolled pod is (k: the
 * connection as it sees it). Connecting: the app's connection to ztunnel's
 * :15001 on the pod's own address (or loopback, for a pod without an
 * address of the family), or ztunnel's (marked) delivery to the app on the
 * pod's own address. Accepting: ztunnel's socket of the former (accepted
 * on :15001, ztunnel's mark inherited from the listener), the app's of the
 * latter (the return mark its SYN got on lo, tcp_fwmark_accept).
 */
static __always_inline int hop_end(struct bpf_sock *sk, struct netns_info *ns, const struct accel_key *k, bool active)
{
	__u16 lport = bpf_ntohs(k->local_port), rport = bpf_ntohs(k->remote_port);
	__u32 mark = sk->mark & ae_cfg.mark_mask;
	bool local_peer = is_pod_addr(ns, &k->remote) || addr_is_loopback(&k->remote);

	if (active) {
		if (mark == ae_cfg.ztunnel_mark)
			return is_pod_addr(ns, &k->remote) && !is_ztunnel_port(rport) ? END_ZTUNNEL : END_NONE;
		return rport == ae_cfg.outbound_port && local_peer ? END_APP : END_NONE;
	}
	if (mark == ae_cfg.ztunnel_mark)
		return lport == ae_cfg.outbound_port && local_peer ? END_ZTUNNEL : END_NONE;
	if (mark == (ae_cfg.return_mark & ae_cfg.mark_mask) && is_pod_addr(ns, &k->local) && !is_ztunnel_port(lport))
		return END_APP;
	return END_NONE;
}

/*
 * Puts an end into the sockhashes its role asks for, by its cookie: a
 * receiver first (it can be redirected to at once), then a sender. 0, or
 * -1 when the kernel refused it (then it is in neither).
 */
static __always_inline int join(struct bpf_sock_ops *skops, int end, __u64 *cookie, struct accel_stats *stats)
{
	bool tx = end == END_APP || accel_into_app;
	bool rx = end == END_ZTUNNEL || accel_into_app;

	if (rx && bpf_sock_hash_update(skops, &ae_accel_rx, cookie, BPF_NOEXIST))
		goto refused;
	if (tx && bpf_sock_hash_update(skops, &ae_accel, cookie, BPF_NOEXIST)) {
		if (rx)
			bpf_map_delete_elem(&ae_accel_rx, cookie);
		goto refused;
	}
	if (stats)
		stats->sockets++;
	return 0;
refused:
	if (stats)
		stats->insert_errors++;
	return -1;
}

/* Which end of a hop an enrolled pod's established socket sk is, with k
 * the connection as it sees it (accepted sockets: as its peer does), or
 * END_NONE. */
static __always_inline int classify_end(struct bpf_sock_ops *skops, struct bpf_sock *sk, bool active, struct accel_key *k)
{
	struct netns_info *ns;
	struct accel_key own;
	__u64 netns;

	if (skops->family != AF_INET && skops->family != AF_INET6)
		return END_NONE;
	/* Data before this point went over TCP (TCP Fast Open): leave it. */
	if (skops->data_segs_out || skops->bytes_received)
		return END_NONE;
	netns = bpf_get_netns_cookie(skops);
	ns = bpf_map_lookup_elem(&ae_netns, &netns);
	if (!ns)
		return END_NONE;
	sockops_key(skops, netns, false, &own);
	if (active) {
		*k = own;
		return hop_end(sk, ns, &own, true);
	}
	sockops_key(skops, netns, true, k);
	return hop_end(sk, ns, &own, false);
}

/*
 * ACTIVE_ESTABLISHED: a connecting end, before its peer exists. It joins,
 * then files the connection for the accepting end, and asks for the state
 * callback that removes the entry when it closes.
 */
static __always_inline void on_active(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct accel_stats *stats;
	struct accel_pair pair = {};
	struct accel_sock *st;
	struct accel_key key;
	int end;

	if (!sk)
		return;
	end = classify_end(skops, sk, true, &key);
	if (end == END_NONE)
		return;
	stats = stats_slot();
	/* The state before the sockhashes: it can send once it is in. */
	st = bpf_sk_storage_get(&ae_accel_sk, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		if (stats)
			stats->insert_errors++;
		return;
	}
	st->cookie = bpf_get_socket_cookie(skops);
	st->peer = 0;
	st->state = AE_ACCEL_UNDECIDED;
	if (join(skops, end, &st->cookie, stats))
		goto out;
	pair.a_cookie = st->cookie;
	pair.a_snd = skops->snd_nxt;
	pair.a_rcv = skops->rcv_nxt;
	/* An entry left by a dead socket of this 4-tuple is replaced: the
	 * tuple is free again, so that socket's connection is over. */
	if (bpf_map_update_elem(&ae_accel_pair, &key, &pair, BPF_ANY)) {
		if (stats)
			stats->insert_errors++;
		goto out; /* in the sockhashes, but no peer will find it */
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	return;
out:
	st->state = AE_ACCEL_PLAIN;
}

/*
 * PASSIVE_ESTABLISHED: an accepted socket joins only as the proven peer of
 * a filed connecting end, before accept() can return it, and then tells
 * that end its cookie. Updating the entry by key (BPF_EXIST) never writes
 * into one that went away or was filed anew meanwhile for someone else: a
 * new entry carries another connecting end's cookie, which the update
 * would overwrite with a cookie it does not own, so that end just finds
 * itself unpaired (TCP).
 */
static __always_inline void on_passive(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct accel_stats *stats;
	struct accel_pair *filed, pair;
	struct accel_sock *st;
	struct accel_key key;
	int end;

	if (!sk)
		return;
	end = classify_end(skops, sk, false, &key);
	if (end == END_NONE)
		return;
	stats = stats_slot();
	filed = bpf_map_lookup_elem(&ae_accel_pair, &key);
	if (!filed) {
		if (stats)
			stats->unpaired++;
		return;
	}
	pair = *filed;
	/* Its sequence numbers, the connecting end's reversed. */
	if (pair.b_cookie || pair.a_snd != skops->rcv_nxt || pair.a_rcv != skops->snd_nxt) {
		if (stats)
			stats->unpaired++;
		return;
	}
	st = bpf_sk_storage_get(&ae_accel_sk, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st) {
		if (stats)
			stats->insert_errors++;
		return;
	}
	st->cookie = bpf_get_socket_cookie(skops);
	st->peer = pair.a_cookie;
	st->state = AE_ACCEL_UNDECIDED;
	if (join(skops, end, &st->cookie, stats)) {
		st->state = AE_ACCEL_PLAIN;
		return;
	}
	pair.b_cookie = st->cookie;
	bpf_map_update_elem(&ae_accel_pair, &key, &pair, BPF_EXIST);
}

/* A connecting end closes: its entry goes, unless another's replaced it. */
static __always_inline void on_close(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct accel_pair *pair;
	struct accel_sock *st;
	struct accel_key key;

	if (!sk)
		return;
	st = bpf_sk_storage_get(&ae_accel_sk, sk, 0, 0);
	if (!st)
		return;
	sockops_key(skops, bpf_get_netns_cookie(skops), false, &key);
	pair = bpf_map_lookup_elem(&ae_accel_pair, &key);
	if (pair && pair->a_cookie == st->cookie)
		bpf_map_delete_elem(&ae_accel_pair, &key);
}

/* sockops: the ends of pod-local hops as they are established. */
SEC("sockops")
int ae_accel_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		on_active(skops);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		on_passive(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == BPF_TCP_CLOSE)
			on_close(skops);
		break;
	}
	return 1;
}

/*
 * The peer of a connecting end that has not sent yet: the accepting end's
 * cookie, once it joined, from the end's own entry (filed under its view
 * of the connection, and still its own).
 */
static __always_inline __u64 filed_peer(struct sk_msg_md *msg, struct bpf_sock *sk, __u64 cookie)
{
	struct accel_pair *pair;
	struct accel_key k;

	__builtin_memset(&k, 0, sizeof(k));
	k.netns_cookie = bpf_get_netns_cookie(msg);
	sock_local(sk, &k.local);
	sock_remote(sk, &k.remote);
	k.local_port = bpf_htons((__u16)sk->src_port);
	k.remote_port = (__be16)sk->dst_port;
	pair = bpf_map_lookup_elem(&ae_accel_pair, &k);
	if (!pair || pair->a_cookie != cookie)
		return 0;
	return pair->b_cookie;
}

/* sk_msg (attached to ae_accel): every send of an end in ae_accel. */
SEC("sk_msg")
int ae_accel_msg(struct sk_msg_md *msg)
{
	struct accel_stats *stats = stats_slot();
	struct bpf_sock *sk = msg->sk;
	struct accel_sock *st;
	bool first;

	if (!sk)
		goto pass;
	st = bpf_sk_storage_get(&ae_accel_sk, sk, 0, 0);
	/* Sends of one socket run one at a time (under its lock). */
	if (!st || st->state == AE_ACCEL_PLAIN)
		goto pass;
	first = st->state == AE_ACCEL_UNDECIDED;
	if (first && !st->peer)
		st->peer = filed_peer(msg, sk, st->cookie);
	if (!st->peer || bpf_msg_redirect_hash(msg, &ae_accel_rx, &st->peer, BPF_F_INGRESS) != SK_PASS) {
		if (first) {
			/* No peer in ae_accel_rx (yet): TCP now, so for good. */
			st->state = AE_ACCEL_PLAIN;
			if (stats)
				stats->plain++;
			goto pass;
		}
		/* The peer closed: TCP answers as it would have. */
		if (stats)
			stats->peer_gone++;
		return SK_PASS;
	}
	if (first) {
		st->state = AE_ACCEL_REDIRECT;
		if (stats)
			stats->redirecting++;
	}
	if (stats) {
		stats->redirect_msgs++;
		stats->redirect_bytes += msg->size;
	}
	return SK_PASS;
pass:
	if (stats)
		stats->pass_msgs++;
	return SK_PASS;
}
