// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package accel

// The object is compiled with clang-19 (BPF2GO_CC, see the Makefile) and
// the outputs are committed; `make check-generated` keeps them honest. It
// loads only where its Linux 5.15 helpers are.
//go:generate go tool bpf2go -tags linux -target bpfel -type accel_key -type accel_stats accel ../../../bpf/accel.c -- -I../../../headers -I../../../bpf/include
