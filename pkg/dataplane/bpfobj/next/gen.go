// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package next is the pinned layout after this build's, for the upgrade
// tests only: the same programs with a field more in a map value
// (AE_LAYOUT_NEXT in bpf/include/common.h). Its objects build only under tag
// ae_layout_next, where package bpfobj re-exports them in place of the
// shipped ones (next_bpfel.go there). No shipped binary has it.
package next

//go:generate go tool bpf2go -tags linux,ae_layout_next -target bpfel -type ae_addr -type pod_info -type netns_info -type pod_meta -type pod_stats -type orig_key -type orig_dst -type probe_key -type probe_nat -type ae_event -type ae_reason Sock ../../../../bpf/sock.c -- -I../../../../headers -I../../../../bpf/include -DAE_LAYOUT_NEXT
//go:generate go tool bpf2go -tags linux,ae_layout_next -target bpfel Tc ../../../../bpf/tc.c -- -I../../../../headers -I../../../../bpf/include -DAE_LAYOUT_NEXT
//go:generate go tool bpf2go -tags linux,ae_layout_next -target bpfel Probe ../../../../bpf/probe.c -- -I../../../../headers -I../../../../bpf/include -DAE_LAYOUT_NEXT
//go:generate go run ../../../../hack/bpfalias -import github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj/next -package bpfobj -tags "linux && ae_layout_next" -o ../next_bpfel.go sock_bpfel.go tc_bpfel.go probe_bpfel.go
