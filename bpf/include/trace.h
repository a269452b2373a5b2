/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Copyright ambient-ebpf authors */

/*
 * Decision counters and trace events, shared by the socket and TC
 * programs. A decision is counted always (ae_decisions); it becomes an
 * event in ae_trace only while a tracer has set ae_tracing. Every site
 * checks the flag before building anything, so with nobody tracing an
 * event costs one load and one branch.
 */
#ifndef AMBIENT_TRACE_H
#define AMBIENT_TRACE_H

#include "maps.h"

/*
 * Non-zero while someone reads ae_trace (`ambient-ebpf trace`, or the
 * agent for its clients). Its own data section, which the loader pins as
 * maps/ae_tracing so both objects and every tracer share it; a global, so
 * reading it is a single load, no map lookup.
 */
volatile __u32 ae_tracing SEC(".data.trace") = 0;

static __always_inline void count_decision(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&ae_decisions, &reason);

	if (n)
		(*n)++;
}

/* A zeroed, time-stamped event to fill and submit, or NULL when the ring
 * is full (counted as lost: the tracer reports it). */
static __always_inline struct ae_event *trace_reserve(__u8 hook, __u8 reason)
{
	struct ae_event *e = bpf_ringbuf_reserve(&ae_trace, sizeof(*e), 0);

	if (!e) {
		count_decision(AE_TRACE_LOST);
		return NULL;
	}
	__builtin_memset(e, 0, sizeof(*e));
	e->ts_ns = bpf_ktime_get_ns();
	e->hook = hook;
	e->reason = reason;
	e->slot = AE_NO_SLOT;
	return e;
}

/* Bytes in the ring past which a submit wakes the reader: 64 events. */
#define AE_TRACE_WAKE_BYTES (64 * sizeof(struct ae_event))

/*
 * Submit without waking the reader unless a batch is waiting. The
 * default (adaptive) wake-up wakes a reader that keeps up for nearly
 * every event, and that wake-up costs several times what building the
 * event does; the reader polls the ring on a short timer instead
 * (pkg/dataplane's Tracer), so a lone event still shows within it.
 */
static __always_inline void trace_submit(struct ae_event *e)
{
	__u64 wake = bpf_ringbuf_query(&ae_trace, BPF_RB_AVAIL_DATA) >= AE_TRACE_WAKE_BYTES ?
			     BPF_RB_FORCE_WAKEUP :
			     BPF_RB_NO_WAKEUP;

	bpf_ringbuf_submit(e, wake);
}

#endif /* AMBIENT_TRACE_H */
