// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * Inbound capture on the pod's own interface, inside the pod netns (TCX
 * ingress, chained: traffic that is not ours goes on to the next program).
 *
 * R5: a TCP flow to an enrolled pod's IP that no socket owns yet is handed
 * to ztunnel's :15006 listener with bpf_sk_assign. No packet is rewritten:
 * the accepted socket's local address is the original destination, which
 * is what ztunnel reads when SO_ORIGINAL_DST has nothing to say.
 * R6: :15008 (HBONE) and R7: flows from the probe SNAT address pass.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "lib.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define TCX_NEXT -1
#define TCX_PASS 0
#define TCX_DROP 2

#define ETH_P_IP_   0x0800
#define ETH_P_IPV6_ 0x86DD
#define IPPROTO_TCP_ 6
#define IP_MF_OFFSET 0x3fff /* more-fragments flag and fragment offset */

struct flow {
	struct ae_addr saddr;
	struct ae_addr daddr;
	struct bpf_sock_tuple tuple;
	bool v6;
	__be16 sport;
	__be16 dport;
	bool syn;
};

/* Parses Ethernet + IPv4/IPv6 + TCP. Returns 0 for a TCP segment whose
 * header is in the linear data; anything else is not ours to touch. */
static __always_inline int parse_tcp(struct __sk_buff *skb, struct flow *f)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct tcphdr *tcp;

	if ((void *)(eth + 1) > data_end)
		return -1;

	if (eth->h_proto == bpf_htons(ETH_P_IP_)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_TCP_ || ip->ihl < 5)
			return -1;
		/* Only the first fragment carries the TCP header. */
		if (ip->frag_off & bpf_htons(0x1fff))
			return -1;
		tcp = (void *)ip + ip->ihl * 4;
		if ((void *)(tcp + 1) > data_end)
			return -1;
		addr_set_v4(&f->saddr, ip->saddr);
		addr_set_v4(&f->daddr, ip->daddr);
		f->tuple.ipv4.saddr = ip->saddr;
		f->tuple.ipv4.daddr = ip->daddr;
		f->tuple.ipv4.sport = tcp->source;
		f->tuple.ipv4.dport = tcp->dest;
		f->v6 = false;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6_)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		/* Extension headers are not walked: TCP directly after the
		 * fixed header is what pods send; anything else passes. */
		if ((void *)(ip6 + 1) > data_end || ip6->nexthdr != IPPROTO_TCP_)
			return -1;
		tcp = (void *)(ip6 + 1);
		if ((void *)(tcp + 1) > data_end)
			return -1;
		__builtin_memcpy(f->saddr.b, &ip6->saddr, 16);
		__builtin_memcpy(f->daddr.b, &ip6->daddr, 16);
		__builtin_memcpy(f->tuple.ipv6.saddr, &ip6->saddr, 16);
		__builtin_memcpy(f->tuple.ipv6.daddr, &ip6->daddr, 16);
		f->tuple.ipv6.sport = tcp->source;
		f->tuple.ipv6.dport = tcp->dest;
		f->v6 = true;
	} else {
		return -1;
	}
	f->sport = tcp->source;
	f->dport = tcp->dest;
	f->syn = tcp->syn && !tcp->ack;
	return 0;
}

/*
 * Whether the segment belongs to a connection the stack already has: an
 * established or half-open socket (ztunnel's own outbound connections,
 * flows accepted earlier). Those are delivered by the normal lookup. A SYN
 * that hits a TIME_WAIT socket starts a new connection and is captured.
 */
static __always_inline bool owned_by_socket(struct __sk_buff *skb, struct flow *f)
{
	struct bpf_sock *sk;
	bool owned;

	/* Constant tuple sizes: the verifier needs a bounded length. */
	if (f->v6)
		sk = bpf_skc_lookup_tcp(skb, &f->tuple, sizeof(f->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_skc_lookup_tcp(skb, &f->tuple, sizeof(f->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return false;
	owned = sk->state != BPF_TCP_LISTEN && !(f->syn && sk->state == BPF_TCP_TIME_WAIT);
	bpf_sk_release(sk);
	return owned;
}

/* Hands the flow to the listener on `port` in this netns. */
static __always_inline int assign_to_listener(struct __sk_buff *skb, struct flow *f, __u16 port)
{
	struct bpf_sock_tuple t = f->tuple;
	struct bpf_sock *sk;
	int err;

	if (f->v6) {
		t.ipv6.dport = bpf_htons(port);
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	} else {
		t.ipv4.dport = bpf_htons(port);
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk)
		return -1;
	if (sk->state != BPF_TCP_LISTEN) {
		bpf_sk_release(sk);
		return -1;
	}
	err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	return err;
}

static __always_inline int capture_inbound(struct __sk_buff *skb)
{
	struct pod_info *pod;
	struct pod_stats *st;
	struct flow f = {};

	if (parse_tcp(skb, &f))
		return TCX_NEXT;
	pod = bpf_map_lookup_elem(&ae_pods, &f.daddr);
	if (!pod || (pod->flags & AE_F_BYPASS_INBOUND))
		return TCX_NEXT;
	if (f.dport == bpf_htons(ae_cfg.hbone_port))
		return TCX_NEXT;
	if (addr_eq(&f.saddr, (struct ae_addr *)&ae_cfg.probe_v4) ||
	    addr_eq(&f.saddr, (struct ae_addr *)&ae_cfg.probe_v6))
		return TCX_NEXT;
	if (owned_by_socket(skb, &f))
		return TCX_NEXT;

	st = pod_stats(pod->slot);
	if (assign_to_listener(skb, &f, ae_cfg.inbound_port)) {
		/* Fail closed: with no ztunnel listener the flow must not
		 * reach the app unredirected. */
		if (st)
			st->inbound_no_listener++;
		return TCX_DROP;
	}
	if (st && f.syn)
		st->inbound_redirects++;
	return TCX_NEXT;
}

/* tcx/ingress on the pod's interface (eth0), inside the pod netns. */
SEC("tcx/ingress")
int ae_pod_ingress(struct __sk_buff *skb)
{
	return capture_inbound(skb);
}
