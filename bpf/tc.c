// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/* Copyright ambient-ebpf authors */

/*
 * The per-pod programs: tc programs and the pod netns' sk_lookup program.
 * The tc programs are attached on every kernel as classic tc filters
 * (cls_bpf, direct action, priority 0xae00, handle 0xae; a TCX attach waits
 * for an RCU grace period). They chain: traffic that is not ours goes on
 * to the next filter (TCX_NEXT, -1, is TC_ACT_UNSPEC there).
 *
 * Inside the pod netns:
 *   ae_pod_steer      sk_lookup: inbound capture (R5-R7) where the kernel
 *                     gives sk_lookup the ingress interface (5.17), and
 *                     the hand-over of flows the tc programs filed.
 *   ae_pod_ingress    on the pod's interface, before 5.17 only: inbound
 *                     capture (R5-R7) by tc.
 *   ae_pod_lo_ingress on lo: marks ztunnel's connections to the app so the
 *                     app's replies route back to ztunnel (R10).
 *   ae_pod_reroute    on virtual interfaces: their TCP goes to :15001 (R14).
 * On the node side of the pod's veth, in SNAT mode only:
 *   ae_host_egress / ae_host_ingress: host-probe SNAT (H1-H3).
 *
 * R5: a TCP flow to an enrolled pod's IP that no socket owns yet is handed
 * to ztunnel's :15006 listener with bpf_sk_assign: by ae_pod_steer, or
 * before 5.17 by ae_pod_ingress (before 6.5, whose tc bpf_sk_assign refuses
 * reuseport listeners, through ae_steer and ae_pod_steer: see steer()). No
 * packet is rewritten: the accepted socket's local address is the original
 * destination, which is what ztunnel reads when SO_ORIGINAL_DST has
 * nothing to say.
 * R6: :15008 (HBONE) and R7: flows from the probe SNAT address pass; in
 * direct mode R7 is off and the flows node sockets filed pass instead (H1).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "lib.h"
#include "trace.h"

char __license[] SEC("license") = "Dual BSD/GPL";

#define TCX_NEXT -1
#define TCX_PASS 0
#define TCX_DROP 2

#define ETH_P_IP_   0x0800
#define ETH_P_IPV6_ 0x86DD
#define IPPROTO_TCP_ 6
#define IP_MF_OFFSET 0x3fff /* more-fragments flag and fragment offset */

#define ETH_HLEN_      14
#define IP_CSUM_OFF    (ETH_HLEN_ + 10)
#define IP_SRC_OFF     (ETH_HLEN_ + 12)
#define IP_DST_OFF     (ETH_HLEN_ + 16)
#define IP6_SRC_OFF    (ETH_HLEN_ + 8)
#define IP6_DST_OFF    (ETH_HLEN_ + 24)
#define TCP_CSUM_OFF   16

struct flow {
	struct ae_addr saddr;
	struct ae_addr daddr;
	struct bpf_sock_tuple tuple;
	__u32 l4_off; /* offset of the TCP header from the start of the frame */
	bool v6;
	__be16 sport;
	__be16 dport;
	bool syn;
	bool fin_or_rst;
	bool over_time_wait; /* a SYN reusing the tuple of a TIME_WAIT socket */
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
		f->l4_off = ETH_HLEN_ + ip->ihl * 4;
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
		f->l4_off = ETH_HLEN_ + sizeof(*ip6);
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
	f->fin_or_rst = tcp->fin || tcp->rst;
	return 0;
}

/*
 * The event of a decision on a parsed flow: its addresses as on the wire,
 * and where it went (to_port 0: nowhere). Called only while tracing.
 */
static __always_inline void trace_flow(__u8 hook, __u8 reason, __u32 slot, __u64 cookie, const struct flow *f,
				       const struct ae_addr *to, __be16 to_port)
{
	struct ae_event *e = trace_reserve(hook, reason);

	if (!e)
		return;
	e->netns_cookie = cookie;
	e->slot = slot;
	e->saddr = f->saddr;
	e->daddr = f->daddr;
	e->sport = f->sport;
	e->dport = f->dport;
	if (to_port) {
		e->to = *to;
		e->to_port = to_port;
	}
	e->proto = IPPROTO_TCP_;
	trace_submit(e);
}

/* A decision on a new flow (its SYN): counted, and traced while tracing.
 * Later segments of the same flow are not decisions of their own. */
static __always_inline void note_flow(__u8 hook, __u8 reason, __u32 slot, __u64 cookie, const struct flow *f,
				      const struct ae_addr *to, __u16 to_port)
{
	if (!f->syn)
		return;
	count_decision(reason);
	if (ae_tracing)
		trace_flow(hook, reason, slot, cookie, f, to, to_port ? bpf_htons(to_port) : 0);
}

/* The slot of the pod whose tc filter runs: the agent gives each pod's
 * filters the class id slot + 1, which cls_bpf hands the program in
 * tc_classid (0, no pod, where another loader attached it). */
static __always_inline __u32 filter_slot(struct __sk_buff *skb)
{
	__u32 classid = skb->tc_classid;

	return classid ? classid - 1 : AE_NO_SLOT;
}

/*
 * Whether the segment belongs to a connection the stack already has: an
 * established or half-open socket (ztunnel's own outbound connections,
 * flows accepted earlier). Those are delivered by the normal lookup. A SYN
 * that meets a TIME_WAIT socket starts a new connection and is captured,
 * but not by bpf_sk_assign: the listener it would be assigned to cannot
 * take a tuple a TIME_WAIT socket still holds, and the SYN would be dropped
 * until TIME_WAIT ends. Such a SYN goes through sk_lookup instead (see
 * steer()), which runs after the kernel's own TIME_WAIT handling.
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
	f->over_time_wait = f->syn && sk->state == BPF_TCP_TIME_WAIT;
	owned = sk->state != BPF_TCP_LISTEN && !f->over_time_wait;
	bpf_sk_release(sk);
	return owned;
}

/*
 * Whether a segment no socket owns belongs to a connection istio-cni's
 * iptables redirected before a takeover (pkg/istiocni, the drain): its
 * REDIRECT gave ztunnel's accepted socket the tuple pod:15006 <-> client,
 * and tc runs before conntrack undoes the translation, so the segment
 * still carries the original destination port. Assigning it to the
 * listener would reset a connection that the drain keeps alive. Asked only
 * for segments other than a SYN whose own tuple no socket owns, which are
 * rare once a pod is enrolled, so the hot path never pays for it. The
 * address stays the pod's: REDIRECT sends an inbound flow to the primary
 * address of the interface it came in on.
 */
static __always_inline bool redirected_by_iptables(struct __sk_buff *skb, const struct flow *f)
{
	struct bpf_sock_tuple t = f->tuple;
	struct bpf_sock *sk;
	bool owned;

	if (f->v6) {
		t.ipv6.dport = bpf_htons(ae_cfg.inbound_port);
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	} else {
		t.ipv4.dport = bpf_htons(ae_cfg.inbound_port);
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk)
		return false;
	owned = sk->state != BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return owned;
}

/*
 * Before 6.5, tc's bpf_sk_assign refuses reuseport listeners, and all of
 * ztunnel's are. The flow is filed in ae_steer instead, for the pod's
 * sk_lookup program, which runs when the SYN looks for a listener and
 * whose bpf_sk_assign does the reuseport selection.
 */
static __always_inline int steer(struct flow *f, struct bpf_sock *sk)
{
	struct steer_key key = {};

	key.saddr = f->saddr;
	key.daddr = f->daddr;
	key.sport = f->sport;
	key.dport = f->dport;
	return bpf_map_update_elem(&ae_steer, &key, sk, BPF_ANY);
}

/*
 * Hands the flow to the listener on `port` in this netns. The listener is
 * looked up from source port 0, which no connection has: with the flow's
 * own client port, a socket holding client:port <-> pod:`port` would shadow
 * the listener. One does after a takeover from istio-cni: ztunnel's
 * accepted socket of a connection istio-cni's REDIRECT sent to :15006, in
 * TIME_WAIT for a minute once the server side closed first, when the
 * client comes back from the same port. The lookup then found no listener
 * and every SYN of the new connection was dropped until TIME_WAIT ended.
 */
static __always_inline int assign_to_listener(struct __sk_buff *skb, struct flow *f, __u16 port)
{
	struct bpf_sock_tuple t = f->tuple;
	struct bpf_sock *sk;
	int err;

	if (f->v6) {
		t.ipv6.sport = 0;
		t.ipv6.dport = bpf_htons(port);
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	} else {
		t.ipv4.sport = 0;
		t.ipv4.dport = bpf_htons(port);
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	}
	if (!sk)
		return -1;
	if (sk->state != BPF_TCP_LISTEN) {
		bpf_sk_release(sk);
		return -1;
	}
	if ((ae_cfg.flags & AE_CFG_SK_ASSIGN_REUSEPORT) && !f->over_time_wait)
		err = bpf_sk_assign(skb, sk, 0);
	else
		err = steer(f, sk);
	bpf_sk_release(sk);
	return err;
}

/*
 * H1 in direct mode: the flow a socket of the node's netns filed as it
 * connected (bpf/probe.c, or file_direct_probe in bpf/sock.c), seen from
 * the pod's new flow (a SYN). It reaches the app with the node's own
 * address, once: the entry goes as it is used (the SYN's later
 * retransmissions meet the app's request socket first), and one no SYN
 * used stops counting AE_PROBE_FLOW_TTL_NS after the connect. A packet that
 * carries the node's address from anywhere else matches no filed flow of
 * that address and port, and is captured (H2).
 */
static __always_inline bool node_probe(const struct ae_addr *pod, __be16 pod_port, const struct ae_addr *peer,
				       __be16 peer_port)
{
	struct probe_key key = {};
	struct probe_nat *nat;
	bool fresh;

	if (!(ae_cfg.flags & AE_CFG_PROBE_DIRECT))
		return false;
	key.pod = *pod;
	key.pod_port = pod_port;
	key.host_port = peer_port;
	nat = bpf_map_lookup_elem(&ae_probe_nat, &key);
	if (!nat || !addr_eq(&nat->host, peer))
		return false;
	fresh = bpf_ktime_get_ns() - nat->last_seen_ns < AE_PROBE_FLOW_TTL_NS;
	bpf_map_delete_elem(&ae_probe_nat, &key);
	return fresh;
}

/* R7: from the probe SNAT address, which only SNAT mode uses; in direct
 * mode such a source is an ordinary client and is captured. */
static __always_inline bool from_probe_address(const struct ae_addr *peer)
{
	if (ae_cfg.flags & AE_CFG_PROBE_DIRECT)
		return false;
	return addr_eq(peer, (struct ae_addr *)&ae_cfg.probe_v4) || addr_eq(peer, (struct ae_addr *)&ae_cfg.probe_v6);
}

static __always_inline int capture_inbound(struct __sk_buff *skb)
{
	struct pod_info *pod;
	struct pod_stats *st;
	struct flow f = {};
	__u8 reason = 0;

	if (parse_tcp(skb, &f))
		return TCX_NEXT;
	pod = bpf_map_lookup_elem(&ae_pods, &f.daddr);
	if (!pod)
		return TCX_NEXT;
	if (pod->flags & AE_F_BYPASS_INBOUND)
		reason = AE_R_INGRESS_MODE;
	else if (f.dport == bpf_htons(ae_cfg.hbone_port))
		reason = AE_R_HBONE;
	else if (from_probe_address(&f.saddr))
		reason = AE_R_PROBE_SOURCE;
	else if (f.syn && node_probe(&f.daddr, f.dport, &f.saddr, f.sport))
		reason = AE_R_PROBE_DIRECT; /* later segments have their socket */
	if (reason) {
		note_flow(AE_HOOK_TC_INGRESS, reason, pod->slot, pod->netns_cookie, &f, NULL, 0);
		return TCX_NEXT;
	}
	if (owned_by_socket(skb, &f))
		return TCX_NEXT;
	if (!f.syn && redirected_by_iptables(skb, &f))
		return TCX_NEXT;

	st = pod_stats(pod->slot);
	if (assign_to_listener(skb, &f, ae_cfg.inbound_port)) {
		/* Fail closed: with no ztunnel listener the flow must not
		 * reach the app unredirected. */
		if (st)
			st->inbound_no_listener++;
		note_flow(AE_HOOK_TC_INGRESS, AE_R_NO_LISTENER, pod->slot, pod->netns_cookie, &f, NULL, 0);
		return TCX_DROP;
	}
	if (st && f.syn)
		st->inbound_redirects++;
	note_flow(AE_HOOK_TC_INGRESS, AE_R_INBOUND, pod->slot, pod->netns_cookie, &f, &f.daddr, ae_cfg.inbound_port);
	return TCX_NEXT;
}

/* tcx/ingress on the pod's interface (eth0), inside the pod netns. */
SEC("tcx/ingress")
int ae_pod_ingress(struct __sk_buff *skb)
{
	return capture_inbound(skb);
}

/*
 * R10, a delivery the enrolment overtook. sockops files ztunnel's
 * connections to the app in ae_local_flows as they connect, but only to an
 * enrolled pod: a connect made just before the enrolment (a takeover from
 * istio-cni enrols pods ztunnel is already serving) is not filed, and if
 * its SYN is looked up after it (a SYN delayed, or retransmitted), the
 * pod's sk_lookup program takes it for inbound traffic and hands it to
 * ztunnel's own :15006 listener, whose request socket then owns the tuple:
 * the delivery hangs until it times out. Here, on lo, the SYN still
 * carries ztunnel's mark, which sk_lookup cannot see, and this runs before
 * that lookup: the flow is filed if it is not yet. Only the pod's address
 * from a foreign one (the client's, kept by ztunnel), only where sk_lookup
 * captures inbound. sockops removes the entry when the socket closes (it
 * asks for the state callback once the connection is established,
 * on_active_established in bpf/sock.c).
 */
static __always_inline void file_overtaken_delivery(const struct flow *f)
{
	struct steer_key key = {};
	struct pod_info *pod;
	__u32 one = 1;

	if (!(ae_cfg.flags & AE_CFG_SK_LOOKUP_IFINDEX) || addr_eq(&f->saddr, &f->daddr))
		return;
	pod = bpf_map_lookup_elem(&ae_pods, &f->daddr);
	if (!pod)
		return;
	key.saddr = f->saddr;
	key.daddr = f->daddr;
	key.sport = f->sport;
	key.dport = f->dport;
	if (bpf_map_lookup_elem(&ae_local_flows, &key))
		return;
	if (bpf_map_update_elem(&ae_local_flows, &key, &one, BPF_NOEXIST) && !bpf_map_lookup_elem(&ae_local_flows, &key)) {
		struct pod_stats *st = pod_stats(pod->slot);

		if (st)
			st->orig_dst_errors++;
		count_decision(AE_R_LOCAL_FLOW_FULL);
	}
}

/*
 * R10: ztunnel delivers inbound traffic from the client's own address
 * (a transparent socket bound to a non-local IP). The app's replies to
 * that address must come back to ztunnel, not leave the pod. ztunnel's
 * SYN arrives here with its socket mark 0x539; turning it into the return
 * mark 0x111 makes the app's accepted socket carry 0x111 (the pod netns
 * has tcp_fwmark_accept set while enrolled), and the pod's policy rule
 * "fwmark 0x111 lookup 100" with "local default dev lo table 100" routes
 * every reply back over lo to ztunnel.
 */
static __always_inline int mark_ztunnel_delivery(struct __sk_buff *skb)
{
	struct flow f = {};

	if (parse_tcp(skb, &f) == 0 && f.syn && mark_is_ztunnel(skb->mark)) {
		file_overtaken_delivery(&f);
		skb->mark = (skb->mark & ~ae_cfg.mark_mask) | ae_cfg.return_mark;
	}
	return TCX_NEXT;
}

/* tcx/ingress on lo, inside the pod netns. */
SEC("tcx/ingress")
int ae_pod_lo_ingress(struct __sk_buff *skb)
{
	return mark_ztunnel_delivery(skb);
}

/*
 * R14: TCP arriving on a virtual interface (a VM's tap, a tunnel) is the
 * pod's own outbound traffic and goes to :15001. Its destination is not a
 * local address, so every segment gets the return mark: the pod's policy
 * rule then delivers it locally, to the socket bpf_sk_assign picked.
 */
static __always_inline int capture_rerouted(struct __sk_buff *skb)
{
	struct pod_stats *st = NULL;
	struct pod_info *pod;
	struct flow f = {};
	__u32 slot;

	if (parse_tcp(skb, &f))
		return TCX_NEXT;
	skb->mark = (skb->mark & ~ae_cfg.mark_mask) | ae_cfg.return_mark;
	if (owned_by_socket(skb, &f))
		return TCX_NEXT;
	/* Per-pod counters: the interface belongs to the pod whose
	 * address the flow's reply will come from; look it up by source
	 * when the VM uses the pod's address, else count nothing. */
	pod = bpf_map_lookup_elem(&ae_pods, &f.saddr);
	if (pod)
		st = pod_stats(pod->slot);
	slot = filter_slot(skb);
	if (assign_to_listener(skb, &f, ae_cfg.outbound_port)) {
		if (st)
			st->inbound_no_listener++;
		note_flow(AE_HOOK_REROUTE, AE_R_NO_LISTENER, slot, 0, &f, NULL, 0);
		return TCX_DROP;
	}
	if (st && f.syn)
		st->reroute_redirects++;
	note_flow(AE_HOOK_REROUTE, AE_R_REROUTE, slot, 0, &f, &f.daddr, ae_cfg.outbound_port);
	return TCX_NEXT;
}

/* tcx/ingress on each of the pod's virtual interfaces (R14). */
SEC("tcx/ingress")
int ae_pod_reroute(struct __sk_buff *skb)
{
	return capture_rerouted(skb);
}

/* Rewrites the IPv4 or IPv6 address at off, fixing the IP (v4) and TCP
 * (pseudo-header) checksums. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, struct flow *f, __u32 off,
					const struct ae_addr *from, const struct ae_addr *to)
{
	__u32 csum_off = f->l4_off + TCP_CSUM_OFF;

	if (!f->v6) {
		__be32 old = addr_words((struct ae_addr *)from)[3], new = addr_words((struct ae_addr *)to)[3];

		if (bpf_l4_csum_replace(skb, csum_off, old, new, BPF_F_PSEUDO_HDR | sizeof(new)) ||
		    bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
			return -1;
		return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0);
	}
	__s64 diff = bpf_csum_diff((__be32 *)from->b, 16, (__be32 *)to->b, 16, 0);

	if (diff < 0 || bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR))
		return -1;
	return bpf_skb_store_bytes(skb, off, to->b, 16, 0);
}

static __always_inline const struct ae_addr *probe_addr(bool v6)
{
	return v6 ? (const struct ae_addr *)&ae_cfg.probe_v6 : (const struct ae_addr *)&ae_cfg.probe_v4;
}

/*
 * H1: TCP from a local socket of the node (kubelet's probes) to an
 * enrolled pod leaves with the probe SNAT source, so R7 lets it reach the
 * app. Only packets that carry a local socket are translated: forwarded
 * traffic (NodePort, load balancers) has none and is captured by R5 (H2).
 * The source port is kept; the translation is keyed by the pod's address,
 * port and that source port, made by the SYN and removed when the socket
 * closes (sockops). A port already taken by another host address, or a
 * full table, leaves the connection untranslated rather than mixing two.
 */
/* H2, for the trace only: a new flow forwarded to an enrolled pod (no
 * local socket) stays as it is. Not counted: that would parse every
 * forwarded packet while nobody traces. */
static __always_inline void trace_forwarded(struct __sk_buff *skb)
{
	struct pod_info *pod;
	struct flow f = {};

	if (parse_tcp(skb, &f) || !f.syn)
		return;
	pod = bpf_map_lookup_elem(&ae_pods, &f.daddr);
	if (pod)
		trace_flow(AE_HOOK_HOST_EGRESS, AE_R_FORWARDED, pod->slot, pod->netns_cookie, &f, NULL, 0);
}

static __always_inline int snat_probe(struct __sk_buff *skb)
{
	struct probe_key key = {};
	struct probe_nat *nat, fresh = {};
	struct pod_info *pod;
	struct pod_stats *st;
	struct flow f = {};

	/* Not attached in direct mode; a filter left from SNAT mode while
	 * the agent switches must not translate what the pod now captures. */
	if (ae_cfg.flags & AE_CFG_PROBE_DIRECT)
		return TCX_NEXT;
	if (!skb->sk) {
		if (ae_tracing)
			trace_forwarded(skb);
		return TCX_NEXT;
	}
	if (parse_tcp(skb, &f))
		return TCX_NEXT;
	pod = bpf_map_lookup_elem(&ae_pods, &f.daddr);
	if (!pod)
		return TCX_NEXT; /* H3: pods outside the mesh are untouched */
	key.pod = f.daddr;
	key.pod_port = f.dport;
	key.host_port = f.sport;
	nat = bpf_map_lookup_elem(&ae_probe_nat, &key);
	if (!nat) {
		if (!f.syn)
			return TCX_NEXT; /* began before the pod was enrolled */
		fresh.host = f.saddr;
		fresh.last_seen_ns = bpf_ktime_get_ns();
		st = pod_stats(pod->slot);
		if (bpf_map_update_elem(&ae_probe_nat, &key, &fresh, BPF_NOEXIST)) {
			if (st)
				st->probe_nat_full++;
			note_flow(AE_HOOK_HOST_EGRESS, AE_R_PROBE_TABLE_FULL, pod->slot, pod->netns_cookie, &f, NULL, 0);
			return TCX_NEXT;
		}
		if (st)
			st->probe_snat++;
		nat = &fresh;
	} else if (!addr_eq(&nat->host, &f.saddr)) {
		note_flow(AE_HOOK_HOST_EGRESS, AE_R_PROBE_PORT_TAKEN, pod->slot, pod->netns_cookie, &f, NULL, 0);
		return TCX_NEXT;
	} else {
		nat->last_seen_ns = bpf_ktime_get_ns();
	}
	if (rewrite_addr(skb, &f, f.v6 ? IP6_SRC_OFF : IP_SRC_OFF, &f.saddr, probe_addr(f.v6))) {
		note_flow(AE_HOOK_HOST_EGRESS, AE_R_REWRITE_ERROR, pod->slot, pod->netns_cookie, &f, NULL, 0);
		return TCX_DROP;
	}
	note_flow(AE_HOOK_HOST_EGRESS, AE_R_PROBE_SNAT, pod->slot, pod->netns_cookie, &f, probe_addr(f.v6), bpf_ntohs(f.sport));
	return TCX_NEXT;
}

/* H1, reply direction: the pod answers the probe address; give the
 * prober its own address back. */
static __always_inline int unsnat_probe(struct __sk_buff *skb)
{
	struct probe_key key = {};
	struct probe_nat *nat;
	struct flow f = {};

	if (ae_cfg.flags & AE_CFG_PROBE_DIRECT)
		return TCX_NEXT;
	if (parse_tcp(skb, &f) || !addr_eq(&f.daddr, probe_addr(f.v6)))
		return TCX_NEXT;
	key.pod = f.saddr;
	key.pod_port = f.sport;
	key.host_port = f.dport;
	nat = bpf_map_lookup_elem(&ae_probe_nat, &key);
	if (!nat)
		return TCX_NEXT;
	if (rewrite_addr(skb, &f, f.v6 ? IP6_DST_OFF : IP_DST_OFF, &f.daddr, &nat->host))
		return TCX_DROP;
	return TCX_NEXT;
}

/* tcx/egress on the node side of an enrolled pod's veth (toward the pod). */
SEC("tcx/egress")
int ae_host_egress(struct __sk_buff *skb)
{
	return snat_probe(skb);
}

/* tcx/ingress on the node side of an enrolled pod's veth (from the pod). */
SEC("tcx/ingress")
int ae_host_ingress(struct __sk_buff *skb)
{
	return unsnat_probe(skb);
}

/*
 * The other half of steer(): flows tc filed for sk_lookup (every inbound
 * flow on kernels whose sk_lookup cannot see the ingress interface; R14
 * flows and SYNs over a TIME_WAIT socket before 6.5). Returns 1 when the
 * flow was filed; *verdict is then the answer.
 */
static __always_inline int steer_filed(struct bpf_sk_lookup *ctx, const struct ae_addr *remote,
				       const struct ae_addr *local, int *verdict)
{
	struct steer_key key = {};
	struct bpf_sock *sk;
	int err;

	key.saddr = *remote;
	key.daddr = *local;
	key.sport = ctx->remote_port;
	/* local_port is in host byte order. */
	key.dport = bpf_htons((__u16)ctx->local_port);
	sk = bpf_map_lookup_elem(&ae_steer, &key);
	if (!sk)
		return 0;
	err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	bpf_map_delete_elem(&ae_steer, &key);
	*verdict = err ? SK_DROP : SK_PASS;
	return 1;
}

/* One of ztunnel's inbound listeners in the pod's netns (see on_listen in
 * sock.c), or NULL. The caller releases it. */
static __always_inline struct bpf_sock *inbound_listener(__u64 netns_cookie)
{
	struct listener_key key = {};
	struct bpf_sock *sk;
	__u16 i;

	key.netns_cookie = netns_cookie;
	key.port = ae_cfg.inbound_port;
	for (i = 0; i < AE_LISTENER_SLOTS; i++) {
		key.idx = i;
		sk = bpf_map_lookup_elem(&ae_listeners, &key);
		if (sk)
			return sk;
	}
	return NULL;
}

/* A decision of the pod's sk_lookup: counted, and traced while tracing. */
static __always_inline void note_lookup(struct bpf_sk_lookup *ctx, __u8 reason, const struct pod_info *pod,
					const struct ae_addr *remote, const struct ae_addr *local, __u16 to_port)
{
	struct ae_event *e;

	count_decision(reason);
	if (!ae_tracing)
		return;
	e = trace_reserve(AE_HOOK_SK_LOOKUP, reason);
	if (!e)
		return;
	e->netns_cookie = pod->netns_cookie;
	e->slot = pod->slot;
	e->saddr = *remote;
	e->daddr = *local;
	e->sport = ctx->remote_port;
	e->dport = bpf_htons((__u16)ctx->local_port);
	if (to_port) {
		e->to = *local;
		e->to_port = bpf_htons(to_port);
	}
	e->proto = IPPROTO_TCP_;
	trace_submit(e);
}

/* What the pod's sk_lookup does with a new flow to it (enum ae_reason):
 * AE_R_INBOUND captures, the rest pass. */
static __always_inline __u8 inbound_decision(struct bpf_sk_lookup *ctx, const struct pod_info *pod,
					     const struct ae_addr *remote, const struct ae_addr *local)
{
	struct steer_key key = {};

	if (pod->flags & AE_F_BYPASS_INBOUND)
		return AE_R_INGRESS_MODE;
	if (ctx->local_port == ae_cfg.hbone_port)
		return AE_R_HBONE;
	/* Connections from inside the pod, delivered over lo but seen with
	 * the pod interface's index: the app to itself or to ztunnel's
	 * :15001 (R1, R4; source and destination are the pod's address), and
	 * ztunnel to the app with the client's address (R10, filed by
	 * sockops). */
	if (addr_eq(remote, local))
		return AE_R_FROM_POD;
	key.saddr = *remote;
	key.daddr = *local;
	key.sport = ctx->remote_port;
	key.dport = bpf_htons((__u16)ctx->local_port);
	if (bpf_map_lookup_elem(&ae_local_flows, &key))
		return AE_R_ZTUNNEL_DELIVERY;
	if (from_probe_address(remote))
		return AE_R_PROBE_SOURCE;
	if (node_probe(local, key.dport, remote, key.sport))
		return AE_R_PROBE_DIRECT;
	return AE_R_INBOUND;
}

/*
 * R5-R7 where sk_lookup sees the ingress interface (5.17): a new inbound
 * TCP flow on the pod's interface goes to ztunnel's :15006 listener.
 * sk_lookup runs only when no established socket owns the segment (and,
 * for a SYN over a TIME_WAIT socket, after the kernel's TIME_WAIT
 * handling), so flows the stack has are never looked at, and no per-packet
 * tc program is needed on the pod's interface. No packet is rewritten: the
 * accepted socket's local address is the original destination. Traffic
 * on other interfaces, and from inside the pod (over lo), is left alone.
 */
static __always_inline int capture_inbound_lookup(struct bpf_sk_lookup *ctx, const struct ae_addr *remote,
						  const struct ae_addr *local)
{
	struct pod_stats *st;
	struct pod_info *pod;
	struct bpf_sock *sk;
	__u8 reason;
	int err;

	pod = bpf_map_lookup_elem(&ae_pods, local);
	if (!pod || pod->ifindex != ctx->ingress_ifindex)
		return SK_PASS;
	reason = inbound_decision(ctx, pod, remote, local);
	if (reason != AE_R_INBOUND) {
		note_lookup(ctx, reason, pod, remote, local, 0);
		return SK_PASS;
	}
	st = pod_stats(pod->slot);
	sk = inbound_listener(pod->netns_cookie);
	if (!sk) {
		/* Fail closed: with no ztunnel listener the flow must not
		 * reach the app unredirected. */
		if (st)
			st->inbound_no_listener++;
		note_lookup(ctx, AE_R_NO_LISTENER, pod, remote, local, 0);
		return SK_DROP;
	}
	err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	if (err) {
		if (st)
			st->inbound_no_listener++;
		note_lookup(ctx, AE_R_ASSIGN_ERROR, pod, remote, local, 0);
		return SK_DROP;
	}
	if (st)
		st->inbound_redirects++;
	note_lookup(ctx, AE_R_INBOUND, pod, remote, local, ae_cfg.inbound_port);
	return SK_PASS;
}

static __always_inline int pod_lookup(struct bpf_sk_lookup *ctx)
{
	struct ae_addr remote, local;
	int verdict;

	if (ctx->protocol != IPPROTO_TCP_)
		return SK_PASS;
	/* Both families' fields are read every time, at constant offsets
	 * from ctx, and pinned there (barrier_var): otherwise clang sinks the
	 * loads into the branches and shares one computed field pointer
	 * between them, which the verifier refuses. */
	__u32 r4 = ctx->remote_ip4, l4 = ctx->local_ip4;
	__u32 r6[4] = {ctx->remote_ip6[0], ctx->remote_ip6[1], ctx->remote_ip6[2], ctx->remote_ip6[3]};
	__u32 l6[4] = {ctx->local_ip6[0], ctx->local_ip6[1], ctx->local_ip6[2], ctx->local_ip6[3]};

	barrier_var(r4);
	barrier_var(l4);
	for (int i = 0; i < 4; i++) {
		barrier_var(r6[i]);
		barrier_var(l6[i]);
	}
	if (ctx->family == AF_INET) {
		addr_set_v4(&remote, r4);
		addr_set_v4(&local, l4);
	} else {
		addr_set_v6(&remote, r6);
		addr_set_v6(&local, l6);
	}
	if (steer_filed(ctx, &remote, &local, &verdict))
		return verdict;
	/* Dead code where the kernel lacks the field: the verifier never
	 * sees ingress_ifindex there. */
	if (ae_cfg.flags & AE_CFG_SK_LOOKUP_IFINDEX)
		return capture_inbound_lookup(ctx, &remote, &local);
	return SK_PASS;
}

/* sk_lookup in the pod netns: inbound capture (R5) where the kernel gives
 * sk_lookup the ingress interface, and the hand-over of flows tc filed. */
SEC("sk_lookup")
int ae_pod_steer(struct bpf_sk_lookup *ctx)
{
	return pod_lookup(ctx);
}
