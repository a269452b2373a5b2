// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

// The BPF objects are built in package bpfobj (and package accel).
//
// A copy of the shared header for TestConstantsMatchCommonH, embedded so
// the test also runs where the sources are not (the kernel suites' VMs).
// (Go refuses a package beside bpf/'s .c files, so it cannot embed the
// one file from there.)
//go:generate cp ../../bpf/common.h testdata/common.h
