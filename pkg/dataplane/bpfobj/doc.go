// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package bpfobj holds the BPF objects compiled from bpf/ (bpf2go outputs,
// committed; gen.go says how they are built), the Go types of their maps,
// and the pinned layout's directories and encodings that every reader and
// writer of the pins shares.
//
// Objects:
//
//	Sock       bpf/sock.c: the node-wide cgroup socket programs and every
//	           shared map (ae_pods, ae_netns, ae_pod_meta, ...)
//	Tc         bpf/tc.c: the per-pod sk_lookup and tc programs
//	Listeners  bpf/listeners.c: the iterator that files ztunnel's
//	           listeners opened before an enrolment
//
// The sockmap acceleration's object is package accel's own. Build tag
// ae_layout_next swaps in the upgrade tests' next layout: package next
// builds it (the same programs with a field more in a map value) and
// next_bpfel.go re-exports it under the same names; no shipped binary
// has it.
//
// Beside them: bpf/include/common.h's #define constants and the contract's
// defaults (defines.go), and where the programs attach: the node-wide
// cgroup hooks, each pod's hooks and our tc filters' identity (hooks.go).
//
// Nothing here loads or attaches anything: package dataplane does.
package bpfobj
