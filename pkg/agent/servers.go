// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// servers are the agent's long-running parts (listeners, the pod source,
// background loops). The first server to stop on its own stops the agent;
// stop waits for all of them, so the agent returns with every listener
// closed and every socket file removed, after a failed start too.
type servers struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// first holds the reason the first server stopped on its own.
	first chan error
}

// newServers returns the group and the context its servers run in.
func newServers(parent context.Context) (*servers, context.Context) {
	ctx, cancel := context.WithCancel(parent)
	return &servers{ctx: ctx, cancel: cancel, first: make(chan error, 1)}, ctx
}

// run runs f in a goroutine as the server called name. Its return stops
// the agent unless the agent is already stopping.
func (s *servers) run(name string, f func() error) {
	s.wg.Go(func() {
		err := f()
		if s.ctx.Err() != nil {
			return // stopping anyway
		}
		if err == nil {
			err = errReturned
		}
		select {
		case s.first <- fmt.Errorf("%s stopped: %w", name, err):
		default: // not the first
		}
	})
}

// watch adds a server already running, which reports on done.
func (s *servers) watch(name string, done <-chan error) {
	s.run(name, func() error { return <-done })
}

// background runs f, which returns when the context ends; stop waits for it.
func (s *servers) background(f func()) { s.wg.Go(f) }

// stopped delivers the reason the first server stopped on its own.
func (s *servers) stopped() <-chan error { return s.first }

// halt cancels every server without waiting for them.
func (s *servers) halt() { s.cancel() }

// stop cancels every server and waits until all have returned. It may be
// called more than once.
func (s *servers) stop() {
	s.cancel()
	s.wg.Wait()
}

// errReturned stands in for the nil error of a server that returned on
// its own.
var errReturned = errors.New("returned without error")
