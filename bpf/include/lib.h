/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Copyright ambient-ebpf authors */

/* Helpers shared by the socket and TC programs. */
#ifndef AMBIENT_LIB_H
#define AMBIENT_LIB_H

#include "common.h"
#include "maps.h" /* pod_stats() looks up ae_stats */

#define AF_INET  2
#define AF_INET6 10

/*
 * Node-wide configuration, rewritten by the agent before load. The
 * defaults are the ambient contract's: ztunnel marks its sockets 0x539
 * under mask 0xfff, listens on 15001 (outbound), 15006 (inbound
 * plaintext), 15008 (HBONE, never redirected) and 15053 (DNS); host
 * probes arrive from 169.254.7.127 / fd16:9254:7127:1337:ffff:ffff:ffff:ffff.
 */
const volatile struct ae_config ae_cfg = {
	.ztunnel_mark  = 0x539,
	.mark_mask     = 0xfff,
	.return_mark   = 0x111,
	.outbound_port = 15001,
	.inbound_port  = 15006,
	.hbone_port    = 15008,
	.dns_port      = 15053,
	.probe_v4      = {.b = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 169, 254, 7, 127}},
	.probe_v6      = {.b = {0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37,
			    0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
};

static __always_inline __u32 *addr_words(struct ae_addr *a)
{
	return (__u32 *)a->b;
}

static __always_inline void addr_set_v4(struct ae_addr *a, __be32 ip)
{
	__u32 *w = addr_words(a);

	w[0] = 0;
	w[1] = 0;
	w[2] = bpf_htonl(0x0000ffff);
	w[3] = ip;
}

static __always_inline void addr_set_v6(struct ae_addr *a, const __u32 *ip6)
{
	__u32 *w = addr_words(a);

	w[0] = ip6[0];
	w[1] = ip6[1];
	w[2] = ip6[2];
	w[3] = ip6[3];
}

static __always_inline bool addr_eq(const struct ae_addr *a, const struct ae_addr *b)
{
	const __u32 *x = (const __u32 *)a->b, *y = (const __u32 *)b->b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

/* ::ffff:a.b.c.d, the form dual-stack sockets use for IPv4 peers. */
static __always_inline bool ip6_is_v4_mapped(const __u32 *ip6)
{
	return ip6[0] == 0 && ip6[1] == 0 && ip6[2] == bpf_htonl(0x0000ffff);
}

/* 127.0.0.0/8: R3 leaves every loopback destination alone. */
static __always_inline bool ip4_is_loopback(__be32 ip)
{
	return (bpf_ntohl(ip) >> 24) == 127;
}

static __always_inline bool ip6_is_loopback(const __u32 *ip6)
{
	return ip6[0] == 0 && ip6[1] == 0 && ip6[2] == 0 && ip6[3] == bpf_htonl(1);
}

static __always_inline bool mark_is_ztunnel(__u32 mark)
{
	return (mark & ae_cfg.mark_mask) == ae_cfg.ztunnel_mark;
}

static __always_inline struct pod_stats *pod_stats(__u32 slot)
{
	return bpf_map_lookup_elem(&ae_stats, &slot);
}

/* 127.0.0.1 or ::1 as the redirect target of the DNS proxy. */
static __always_inline bool addr_is_loopback(const struct ae_addr *a)
{
	const __u32 *w = (const __u32 *)a->b;

	if (w[0] == 0 && w[1] == 0 && w[2] == bpf_htonl(0x0000ffff))
		return ip4_is_loopback(w[3]);
	return ip6_is_loopback(w);
}

#endif /* AMBIENT_LIB_H */
