// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// The history keeps the window by time and by count, oldest first, and
// an agent without one refuses a replay before opening anything.
func TestTraceHistoryKeepsTheWindow(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	h := newTraceHub(t.TempDir(), time.Minute, log)
	now := time.Now()
	for _, age := range []time.Duration{3 * time.Minute, 2 * time.Minute, 30 * time.Second, time.Second} {
		h.remember(inspect.Event{Time: now.Add(-age), Pod: age.String()})
	}
	var got []string
	for _, e := range h.past {
		got = append(got, e.Pod)
	}
	if len(got) != 2 || got[0] != "30s" || got[1] != "1s" {
		t.Errorf("history after events 3m, 2m, 30s and 1s old with a 1m window: %v, want [30s 1s]", got)
	}
	for range maxHistory + 10 {
		h.remember(inspect.Event{Time: now})
	}
	if len(h.past) != maxHistory {
		t.Errorf("history holds %d events, want at most %d", len(h.past), maxHistory)
	}

	off := newTraceHub(t.TempDir(), 0, log)
	if _, _, err := off.subscribe("", now.Add(-time.Minute)); !errors.Is(err, errNoHistory) {
		t.Errorf("replay from a hub without history: %v, want errNoHistory", err)
	}
	off.remember(inspect.Event{Time: now})
	if len(off.past) != 0 {
		t.Error("a hub without history kept an event")
	}
}
