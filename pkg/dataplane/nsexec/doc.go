// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package nsexec runs code inside a network namespace and reads what a
// thread sees there (its netns cookie, an interface's index), for the
// data path's loader and its read-only views alike.
package nsexec
