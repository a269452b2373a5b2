// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package include holds the headers the programs in bpf/ share. Its Go
// side only embeds common.h, so that the test holding Go's copies of its
// #define constants (package bpfobj) reads the one file, also where the
// sources are not (the kernel suites' VMs). The C sources stay one level
// up: Go refuses a package beside .c files.
package include

import _ "embed"

// CommonH is common.h: the maps' keys and values, flags and reasons that
// every program and the agent share.
//
//go:embed common.h
var CommonH string
