// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// countingSweeper counts sweeps and fails the ones listed in fail.
type countingSweeper struct {
	mu    sync.Mutex
	calls int
	fail  map[int]error
}

func (s *countingSweeper) SweepProbeFlows() (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	return 1, s.fail[s.calls]
}

func (s *countingSweeper) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls
}

// The sweep runs once per bpfobj.ProbeFlowTTL, logs a failed one and goes
// on, and ends with its context.
func TestSweepProbeFlowsEveryTTLUntilCancelled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var logs bytes.Buffer
		a := &agent{log: slog.New(slog.NewTextHandler(&logs, nil))}
		dp := &countingSweeper{fail: map[int]error{2: errors.New("map walk: EPERM")}}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan struct{})
		go func() {
			a.sweepProbeFlows(ctx, dp)
			close(done)
		}()

		time.Sleep(bpfobj.ProbeFlowTTL / 2)
		synctest.Wait()
		if n := dp.count(); n != 0 {
			t.Fatalf("%d sweeps before the first period ended, want 0", n)
		}
		time.Sleep(3 * bpfobj.ProbeFlowTTL)
		synctest.Wait()
		if n := dp.count(); n != 3 {
			t.Errorf("%d sweeps in 3.5 periods, want 3", n)
		}
		if !strings.Contains(logs.String(), "map walk: EPERM") {
			t.Errorf("the failed sweep was not logged; logs:\n%s", logs.String())
		}

		cancel()
		synctest.Wait()
		select {
		case <-done:
		default:
			t.Fatal("the sweeper did not return when its context ended")
		}
		time.Sleep(2 * bpfobj.ProbeFlowTTL)
		if n := dp.count(); n != 3 {
			t.Errorf("%d sweeps after the context ended, want 3", n)
		}
	})
}
