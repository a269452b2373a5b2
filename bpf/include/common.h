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

/* Kernel features the loader found, and the node's modes (struct
 * ae_config.flags). Branches on them are dead code where they are off, so
 * the verifier never sees a helper the kernel does not have. */
#define AE_CFG_NETNS_COOKIE_SOCKOPS (1U << 0) /* Linux 5.15 */
#define AE_CFG_NETNS_COOKIE_SOCKOPT (1U << 1) /* Linux 5.15 */
#define AE_CFG_SK_ASSIGN_REUSEPORT  (1U << 2) /* Linux 6.5: tc's bpf_sk_assign takes reuseport
                                                * listeners; set where TCX (6.6) is */
#define AE_CFG_SK_LOOKUP_IFINDEX    (1U << 3) /* Linux 5.17: sk_lookup sees the ingress
                                                * interface, so it alone captures inbound */
#define AE_CFG_PROBE_DIRECT         (1U << 4) /* host probes reach the app with the node's
                                                * address, untranslated (H1 direct) */
#define AE_CFG_NODE_SCOPE           (1U << 5) /* these socket programs are the node-wide half
                                                * of a split attach: the node's own sockets
                                                * only (host probes); the pods' cgroup has
                                                * the rest */
#define AE_CFG_PROBE_CONNECT        (1U << 6) /* with AE_CFG_PROBE_DIRECT: bpf/probe.c files
                                                * the node's probes at tcp_connect(); the
                                                * socket programs leave them alone */

/* How long after its connect a host probe's filed flow lets the probe's
 * SYN reach the app (H1, direct mode); the pod's programs remove it when
 * they do. Covers SYN retransmissions within a kubelet probe's timeout. */
#define AE_PROBE_FLOW_TTL_NS 10000000000ULL /* 10 s */

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
#ifdef AE_LAYOUT_NEXT
	/* Only in the test-only build of the next pinned layout (build tag
	 * ae_layout_next, pkg/dataplane/upgrade/layout_next.go): a field the
	 * shipped layout lacks, so the upgrade tests upgrade a real change. */
	__u64 next_generation;
#endif
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

/* Key of ae_listeners: one of ztunnel's listeners in an enrolled pod (only
 * an enrolled netns's are filed: at most AE_LISTENER_SLOTS each). */
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
	/* Set to 1 in ae_orig_dst once the proxy asked (SO_ORIGINAL_DST): an
	 * uninstall, having ended capture, waits for the unread ones before
	 * the program that answers goes. Still named pad: a renamed field is
	 * a new pinned layout, whose migration copies ae_orig_dst while the
	 * old programs still file entries in the old map, and a connection
	 * between its connect() and ztunnel's accept then lost its original
	 * destination (seen in the upgrade test from v0.1.0). */
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
	__u64 probe_snat;          /* H1: host probe connections translated, or filed (direct) */
	__u64 probe_nat_full;      /* H1: probes left untranslated, table full */
};

/* Key of ae_probe_nat: a host-probe connection as the pod sees it (after
 * the translation, in SNAT mode). */
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

/* Where a decision is made (struct ae_event.hook); pkg/dataplane's
 * Hook names them. */
enum ae_hook {
	AE_HOOK_NONE,
	AE_HOOK_CONNECT4,
	AE_HOOK_CONNECT6,
	AE_HOOK_SENDMSG4,
	AE_HOOK_SENDMSG6,
	AE_HOOK_SOCKOPS,
	AE_HOOK_SK_LOOKUP,
	AE_HOOK_TC_INGRESS,  /* the pod's interface, before Linux 5.17 */
	AE_HOOK_REROUTE,     /* a virtual interface (R14) */
	AE_HOOK_HOST_EGRESS, /* the node side of the pod's veth (H1, H2) */
};

/* Why a hook decided what it did. Each reason implies its decision
 * (captured, passed, dropped, translated or error) and a contract row;
 * pkg/dataplane's Reason names them, in this order. ae_decisions counts
 * them, keyed by this enum. */
enum ae_reason {
	AE_R_NONE,
	AE_R_NOT_ENROLLED,     /* passed: no enrolled pod's socket (R16); traced, not counted */
	AE_R_ZTUNNEL_MARK,     /* passed: ztunnel's own socket (R2) */
	AE_R_LOOPBACK,         /* passed (R3) */
	AE_R_OWN_IP,           /* passed: to the pod's own address (R4) */
	AE_R_PROBE_DEST,       /* passed: to the probe address (R8) */
	AE_R_UDP_NOT_DNS,      /* passed (R11) */
	AE_R_DNS_CAPTURE_OFF,  /* passed (R13) */
	AE_R_NOT_TCP,          /* passed (R11) */
	AE_R_OUTBOUND,         /* captured to :15001 (R1) */
	AE_R_DNS,              /* captured to :15053 (R9) */
	AE_R_ORIG_DST_ERROR,   /* error: connect() fails (R1) */
	AE_R_INBOUND,          /* captured to :15006 (R5) */
	AE_R_INGRESS_MODE,     /* passed (R12) */
	AE_R_HBONE,            /* passed: to :15008 (R6) */
	AE_R_FROM_POD,         /* passed: from the pod itself (R4) */
	AE_R_ZTUNNEL_DELIVERY, /* passed: ztunnel to the app (R10) */
	AE_R_PROBE_SOURCE,     /* passed: from the probe address (R7) */
	AE_R_NO_LISTENER,      /* dropped: no ztunnel listener (fail closed) */
	AE_R_ASSIGN_ERROR,     /* dropped: bpf_sk_assign refused */
	AE_R_REROUTE,          /* captured to :15001 (R14) */
	AE_R_PROBE_SNAT,       /* translated (H1) */
	AE_R_FORWARDED,        /* passed: no local socket (H2); traced, not counted */
	AE_R_PROBE_PORT_TAKEN, /* passed: another prober holds the port (H1) */
	AE_R_PROBE_TABLE_FULL, /* error: ae_probe_nat full (H1) */
	AE_R_REWRITE_ERROR,    /* dropped: the packet could not be rewritten (H1) */
	AE_R_ORIG_DST_FULL,    /* error: ae_orig_dst full (R1) */
	AE_R_LOCAL_FLOW_FULL,  /* error: ae_local_flows full (R10) */
	AE_R_LISTENER_FULL,    /* error: ae_listeners full, ztunnel's listener not filed (R5) */
	AE_R_PROBE_DIRECT,     /* passed: a node socket's own flow, direct mode (H1) */
	AE_R_MAX,
};

/* ae_decisions slots: one per reason, and the events the trace lost
 * (ring buffer full) in the last. */
#define AE_DECISION_SLOTS 32
#define AE_TRACE_LOST     (AE_DECISION_SLOTS - 1)

#define AE_NO_SLOT 0xffffffffU /* struct ae_event.slot: no enrolled pod */

/* One decision, as the programs emit it into ae_trace while someone
 * traces. Addresses as everywhere (IPv4-mapped for IPv4), ports in
 * network byte order. */
struct ae_event {
	__u64 ts_ns;          /* bpf_ktime_get_ns() */
	__u64 netns_cookie;   /* the pod's netns; 0 where the hook does not know it */
	struct ae_addr saddr; /* zero: not bound yet (connect) */
	struct ae_addr daddr; /* the destination as sent: the original one */
	struct ae_addr to;    /* captured: where it went; translated: the new source */
	__be16 sport;
	__be16 dport;
	__be16 to_port;
	__u8 proto;  /* IPPROTO_* */
	__u8 hook;   /* enum ae_hook */
	__u8 reason; /* enum ae_reason */
	__u8 pad[3];
	__u32 slot; /* the pod's ae_pod_meta slot, AE_NO_SLOT for none */
};

/* Key of ae_accel_pair: a connection between an app and ztunnel inside a
 * pod (sockmap acceleration), as its connecting end sees it. */
struct accel_key {
	__u64 netns_cookie;
	struct ae_addr local;
	struct ae_addr remote;
	__be16 local_port;
	__be16 remote_port;
	__u32 pad;
};

/* Value of ae_accel_pair: who the two ends are. The connecting end files
 * it with its socket cookie and initial sequence numbers; the accepting end
 * proves it is the other end of that very connection by the sequence
 * numbers (a 4-tuple alone can belong to a closed socket whose owner still
 * holds it) and adds its cookie. */
struct accel_pair {
	__u64 a_cookie; /* the connecting end */
	__u64 b_cookie; /* the accepting end; 0 until it is in */
	__u32 a_snd;    /* the connecting end's snd_nxt when established: ISS + 1 */
	__u32 a_rcv;    /* its rcv_nxt then: the accepting end's ISS + 1 */
};

/* struct accel_sock.state: what one end of a hop does with its sends. */
#define AE_ACCEL_UNDECIDED 1 /* has not sent yet */
#define AE_ACCEL_REDIRECT  2 /* its peer was in ae_accel_rx at its first send */
#define AE_ACCEL_PLAIN     3 /* its peer was not: TCP for good */

/* Value of ae_accel_sk (socket storage) for each end of a hop. */
struct accel_sock {
	__u64 cookie; /* its own socket cookie */
	__u64 peer;   /* the other end's, once known (0: not yet) */
	__u32 state;  /* AE_ACCEL_* */
	__u32 pad;
};

/* Counters of the sockmap acceleration (ae_accel_stats, per CPU). */
struct accel_stats {
	__u64 sockets;        /* sockets put into ae_accel or ae_accel_rx */
	__u64 insert_errors;  /* sockets the kernel refused (MPTCP, kTLS, table full): TCP */
	__u64 unpaired;       /* accepted sockets with no proven connecting end: TCP */
	__u64 redirecting;    /* ends whose peer was in ae_accel_rx at their first send */
	__u64 plain;          /* ends whose peer was not: TCP for good */
	__u64 redirect_msgs;  /* sends handed to the peer socket */
	__u64 redirect_bytes;
	__u64 pass_msgs;      /* sends that went through TCP */
	__u64 peer_gone;      /* sends whose peer had left ae_accel_rx (closed): TCP */
};

#endif /* AMBIENT_COMMON_H */
