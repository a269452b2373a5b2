/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Copyright ambient-ebpf authors */

/*
 * Layouts shared by the BPF programs and the Go side (bpf2go turns the types
 * named with -type into Go structs). Every address is stored as 16 bytes:
 * IPv4 as IPv4-mapped IPv6 (::ffff:a.b.c.d), so one key type serves both
 * families and a dual-stack socket's mapped addresses need no translation.
 */
#ifndef AMBIENT_COMMON_H
#define AMBIENT_COMMON_H

/* Pod flags (struct pod_info.flags, struct netns_info.flags). */
#define AE_F_HAS_V4         (1U << 0) /* the pod has an IPv4 address */
#define AE_F_HAS_V6         (1U << 1) /* the pod has an IPv6 address */
#define AE_F_BYPASS_INBOUND (1U << 2) /* R12: ingress mode, no inbound capture */
#define AE_F_DNS_CAPTURE    (1U << 3) /* R9/R13: capture DNS to ztunnel */

#define AE_MAX_PODS 8192

/* Kernel features the loader found (struct ae_config.flags). Branches on
 * them are dead code on kernels without the feature, so the verifier never
 * sees a helper the kernel does not have. */
#define AE_CFG_NETNS_COOKIE_SOCKOPS (1U << 0) /* Linux 5.15 */
#define AE_CFG_NETNS_COOKIE_SOCKOPT (1U << 1) /* Linux 5.15 */
#define AE_CFG_SK_ASSIGN_REUSEPORT  (1U << 2) /* Linux 6.5: tc's bpf_sk_assign takes reuseport
                                                * listeners; set where TCX (6.6) is */
#define AE_CFG_SK_LOOKUP_IFINDEX    (1U << 3) /* Linux 5.17: sk_lookup sees the ingress
                                                * interface, so it alone captures inbound */

/* struct pod_meta.state: the enrolment journal. A pod's slot is written
 * ENROLLING (with what must be restored) before the node is touched and
 * REMOVING before anything is taken away; a restarted agent finds either
 * and undoes what the dead one left, so no pod stays half redirected. */
#define AE_META_FREE      0
#define AE_META_ENROLLED  1
#define AE_META_ENROLLING 2
#define AE_META_REMOVING  3

/* ae_listeners keeps up to this many of ztunnel's listeners per pod and
 * port: a rollout briefly has two ztunnels, and either may close first. */
#define AE_LISTENER_SLOTS 4

struct ae_addr {
	__u8 b[16];
} __attribute__((aligned(4))); /* compared as four 32-bit words */

/* Value of ae_pods, keyed by pod IP: what the TC and sk_lookup programs need. */
struct pod_info {
	__u64 netns_cookie; /* owner's netns; a reused IP gets a new owner */
	__u32 slot;         /* index into ae_pod_meta and ae_stats */
	__u32 flags;
	__u32 ifindex;      /* the pod interface inbound traffic arrives on (R5) */
	__u32 pad;
};

/* Value of ae_netns, keyed by the pod's netns cookie: what the socket hooks need. */
struct netns_info {
	struct ae_addr ip4; /* ::ffff:a.b.c.d, valid with AE_F_HAS_V4 */
	struct ae_addr ip6; /* valid with AE_F_HAS_V6 */
	__u32 slot;
	__u32 flags;
};

/* Value of ae_pod_meta, indexed by slot. Read by user space only: it lets
 * the agent, the CLI and bpftool name every enrolled pod after a restart. */
struct pod_meta {
	char uid[64];
	char namespace[64];
	char name[256];       /* DNS-1123 subdomain: at most 253 */
	char ifname[16];      /* the pod-side interface */
	char host_ifname[16]; /* the node side of the pod's veth */
	char netns[128];      /* the netns path the agent used (checked by cookie before use) */
	__u64 netns_cookie;
	__u32 state;               /* AE_META_* */
	__u32 saved_fwmark_accept; /* the pod's tcp_fwmark_accept before enrollment, read once */
};

/* Key of ae_listeners: one of ztunnel's listeners in an enrolled pod. */
struct listener_key {
	__u64 netns_cookie;
	__u16 port; /* host byte order */
	__u16 idx;  /* 0 .. AE_LISTENER_SLOTS-1 */
	__u32 pad;
};

/* The original destination of a redirected connection. */
struct orig_dst {
	struct ae_addr addr;
	__be16 port;
	__u16 family; /* AF_INET (also for IPv4-mapped sockets) or AF_INET6 */
	__u32 pad;
};

/* Key of ae_orig_dst: the redirected client socket as the proxy's accepted
 * socket sees its peer, scoped by netns so pods never collide. */
struct orig_key {
	__u64 netns_cookie;
	struct ae_addr addr;
	__be16 port;
	__u16 pad[3];
};

/* Key of ae_steer: a new inbound flow, as TC and sk_lookup both see it. */
struct steer_key {
	struct ae_addr saddr;
	struct ae_addr daddr;
	__be16 sport;
	__be16 dport;
	__u32 pad;
};

/* Per-pod counters in ae_stats (per CPU, indexed by slot). */
struct pod_stats {
	__u64 outbound_redirects;  /* R1: connects sent to :15001 */
	__u64 inbound_redirects;   /* R5: flows assigned to :15006 */
	__u64 inbound_no_listener; /* R5/R14 with no ztunnel listener: dropped */
	__u64 orig_dst_errors;     /* original destination could not be kept */
	__u64 dns_redirects;       /* R9: DNS queries sent to :15053 */
	__u64 reroute_redirects;   /* R14: flows from virtual interfaces to :15001 */
	__u64 probe_snat;          /* H1: host probe connections translated */
	__u64 probe_nat_full;      /* H1: probes left untranslated, table full */
};

/* Key of ae_probe_nat: a host-probe connection as the pod sees it. */
struct probe_key {
	struct ae_addr pod;  /* the enrolled pod's address */
	__be16 pod_port;     /* the probed port */
	__be16 host_port;    /* the prober's (kept) source port */
	__u32 pad;
};

/* Value of ae_probe_nat: the prober's real source address. */
struct probe_nat {
	struct ae_addr host;
	__u64 last_seen_ns; /* for the agent's sweep of abandoned entries */
};

/* Node-wide settings, set from Go before load (const volatile: the
 * verifier prunes branches on them). Ports are host byte order. */
struct ae_config {
	__u32 ztunnel_mark;
	__u32 mark_mask;
	__u32 return_mark; /* R10/R14: routed to the pod's local table */
	__u32 flags;       /* AE_CFG_*: what the running kernel offers */
	__u16 outbound_port;
	__u16 inbound_port;
	__u16 hbone_port;
	__u16 dns_port;
	struct ae_addr probe_v4;
	struct ae_addr probe_v6;
};

#endif /* AMBIENT_COMMON_H */
