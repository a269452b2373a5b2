// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package testenv holds the few rules every kernel test follows: who may
// skip, and how names are made unique per run so parallel runs never collide.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
)

// InCI reports whether the tests run under CI=true, where a test that cannot
// run what it claims to test must fail instead of skip.
func InCI() bool { return os.Getenv("CI") == "true" }

// SkipOrFail skips the test, or fails it under CI=true.
func SkipOrFail(tb testing.TB, format string, args ...any) {
	tb.Helper()
	if InCI() {
		tb.Fatalf("CI=true forbids skipping: "+format, args...)
	}
	tb.Skipf(format, args...)
}

// RequireRoot skips (fails under CI) when the test does not run as root.
// Under -short (make test-unit) it always skips, also as root: the short
// loop runs what needs no kernel, and a skip there is expected, not a
// failure.
func RequireRoot(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("needs root for netns, cgroups and BPF: not under -short (make test-unit)")
	}
	if os.Geteuid() != 0 {
		SkipOrFail(tb, "needs root for netns, cgroups and BPF")
	}
}

// RunID returns a short random hex string for naming the resources of one
// test run (netns, links, cgroups, bpffs directories).
func RunID() string {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b[:])
}
