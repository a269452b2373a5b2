// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

// The BPF objects are compiled with clang-19 (BPF2GO_CC, see the Makefile)
// and the outputs are committed; `make check-generated` keeps them honest.
// The sockmap acceleration loads only where its Linux 5.15 helpers are.
//go:generate go tool bpf2go -tags linux -target bpfel -type accel_key -type accel_stats accel ../../bpf/accel.c -- -I../../headers -I../../bpf

// A copy of the shared header for TestConstantsMatchCommonH, embedded so
// the test also runs where the sources are not (the kernel suites' VMs).
//go:generate cp ../../bpf/common.h testdata/common.h
