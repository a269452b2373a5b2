// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package testenv

import (
	"testing"
	"time"
)

// Poll asks until cond holds and says so; a cond that never holds makes it
// say false once the timeout passed, and it asks at least once even when
// the timeout is already spent.
func TestPollSaysWhetherCondHeld(t *testing.T) {
	calls := 0
	if !Poll(time.Minute, func() bool { calls++; return calls == 3 }) || calls != 3 {
		t.Errorf("Poll of a cond true on the third call: calls %d, want true after 3", calls)
	}
	if Poll(50*time.Millisecond, func() bool { return false }) {
		t.Error("Poll of a cond that never holds said true")
	}
	calls = 0
	if !Poll(0, func() bool { calls++; return true }) || calls != 1 {
		t.Errorf("Poll with no time left: calls %d, want one call that holds", calls)
	}
}

// PollEvery answers as Poll does, asking at the interval it is given.
func TestPollEverySaysWhetherCondHeld(t *testing.T) {
	calls := 0
	if !PollEvery(time.Millisecond, time.Minute, func() bool { calls++; return calls == 3 }) || calls != 3 {
		t.Errorf("PollEvery of a cond true on the third call: calls %d, want true after 3", calls)
	}
	if PollEvery(time.Millisecond, 20*time.Millisecond, func() bool { return false }) {
		t.Error("PollEvery of a cond that never holds said true")
	}
}
