// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func draws(seed uint64, n int) []string {
	s := newSchedule(seed)
	var out []string
	for range n {
		out = append(out, string(s.next()), s.pause(time.Second, 2*time.Second).String(), string(rune('a'+s.pick(5))))
	}
	return out
}

// A seed replays its schedule: the same faults and pauses, in order.
func TestScheduleReplaysItsSeed(t *testing.T) {
	if a, b := draws(42, 200), draws(42, 200); !slices.Equal(a, b) {
		t.Fatal("seed 42 drew two different schedules")
	}
	if slices.Equal(draws(42, 50), draws(43, 50)) {
		t.Error("seeds 42 and 43 drew the same schedule")
	}
	seen := map[string]bool{}
	s := newSchedule(1)
	for range 2000 {
		seen[string(s.next())] = true
	}
	for _, w := range weights {
		if !seen[string(w.f)] {
			t.Errorf("%s never drawn in 2000 faults", w.f)
		}
	}
}

func TestSettingsRefuseWhatTheyCannotRead(t *testing.T) {
	for _, tc := range []struct{ env, value, want string }{
		{"SOAK_DURATION", "forever", "SOAK_DURATION"},
		{"SOAK_DURATION", "-1m", "positive"},
		{"SOAK_SEED", "-3", "SOAK_SEED"},
		{"SOAK_FAULTS", "agent_sigkill,meteor", "meteor"},
	} {
		t.Setenv(tc.env, tc.value)
		if _, err := readSettings(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s=%s: %v, want an error naming %s", tc.env, tc.value, err, tc.want)
		}
		t.Setenv(tc.env, "")
	}
	t.Setenv("SOAK_DURATION", "1h")
	t.Setenv("SOAK_SEED", "12")
	if s, err := readSettings(); err != nil || s.duration != time.Hour || s.seed != 12 {
		t.Errorf("SOAK_DURATION=1h SOAK_SEED=12: %+v, %v", s, err)
	}
}

func TestScheduleDrawsOnlyTheFaultsAsked(t *testing.T) {
	s := newSchedule(5, agentKill, podAdd)
	for range 500 {
		if f := s.next(); f != agentKill && f != podAdd {
			t.Fatalf("drew %s, asked for agent_sigkill and pod_add only", f)
		}
	}
}
