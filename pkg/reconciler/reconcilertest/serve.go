// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconcilertest

import (
	"context"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// Source is a pod source as the agent drives it (kube.Controller,
// standalone.Source).
type Source interface {
	Start(ctx context.Context) error
	Run(ctx context.Context, sink reconciler.Desired) error
}

// Serve runs src as the agent does: Start, then between (the agent's
// snapshot step, when set), then Run reporting to sink in the background.
// stop ends Run and checks its error; it also runs when the test ends.
func Serve(t testing.TB, src Source, sink reconciler.Desired, between func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if err := src.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	if between != nil {
		between()
	}
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, sink) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}
