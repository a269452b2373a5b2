// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package testenv holds the few rules every kernel test follows: who may
// skip, how names are made unique per run so parallel runs never collide,
// and the one way a test waits for something to become true.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
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

// pollInterval is how often Poll and Eventually ask again: short enough
// that a wait ends soon after its condition holds, long enough that a
// condition asking an API server or reading a map stays cheap.
const pollInterval = 20 * time.Millisecond

// Poll calls cond at once and then every 20 ms until it returns true or
// timeout passes, and reports whether it returned true. It is the tests'
// one wait loop: use it directly where running out of time is a finding
// to report in the caller's own words (or no failure at all), and
// Eventually where it just fails the test.
func Poll(timeout time.Duration, cond func() bool) bool {
	return PollEvery(pollInterval, timeout, cond)
}

// PollEvery is Poll asking every interval: for a wait that is itself a
// measurement (the benchmark's time to ready), where 20 ms would be the
// figure's resolution.
func PollEvery(interval, timeout time.Duration, cond func() bool) bool {
	err := wait.PollUntilContextTimeout(context.Background(), interval, timeout, true,
		func(context.Context) (bool, error) { return cond(), nil })
	return err == nil
}

// Eventually polls cond (see Poll) until it returns true, and fails the
// test, naming what it waited for, when timeout passes first.
func Eventually(tb testing.TB, timeout time.Duration, what string, cond func() bool) {
	tb.Helper()
	if !Poll(timeout, cond) {
		tb.Fatalf("timed out after %v waiting: %s", timeout, what)
	}
}
