// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bpfobj

// The BPF objects are compiled with clang-19 (BPF2GO_CC, see the Makefile)
// and the outputs are committed; `make check-generated` keeps them honest.
//go:generate go tool bpf2go -tags linux,!ae_layout_next -target bpfel -type ae_addr -type pod_info -type netns_info -type pod_meta -type pod_stats -type orig_key -type orig_dst -type probe_key -type probe_nat -type ae_event -type ae_reason Sock ../../../bpf/sock.c -- -I../../../headers -I../../../bpf/include
//go:generate go tool bpf2go -tags linux,!ae_layout_next -target bpfel Tc ../../../bpf/tc.c -- -I../../../headers -I../../../bpf/include
// Host probes filed at tcp_connect() (fentry; the direct mode where the
// kernel takes it); loaded next to the sock object, on its maps.
//go:generate go tool bpf2go -tags linux,!ae_layout_next -target bpfel Probe ../../../bpf/probe.c -- -I../../../headers -I../../../bpf/include
// The iterator that files listeners ztunnel opened before the enrolment
// (sk_lookup mode, Linux 5.17); loaded unpinned, next to the sock object.
// Its BTF (struct sock's whole type graph) comes out of clang-19 in an
// order that depends on the length of the directory it is built in: the
// committed object is the one `make check-generated` builds (a
// /tmp/tmp.XXXXXXXXXX copy), so a `go generate` elsewhere may differ in
// .BTF alone.
//go:generate go tool bpf2go -tags linux -target bpfel Listeners ../../../bpf/listeners.c -- -I../../../headers -I../../../bpf/include

// The next pinned layout of the upgrade tests (package upgrade's
// layout_next.go) is built in package next (build tag ae_layout_next),
// and next_bpfel.go re-exports it here.
