// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package unixsocktest has unix socket peers for tests.
package unixsocktest

import (
	"net"
	"path/filepath"
	"sync"
	"testing"
)

// Mute listens on a fresh stream socket in a temp directory, accepts every
// connection and never reads or writes: an agent that accepts but never
// answers. It returns the socket path; everything closes when the test
// ends.
func Mute(tb testing.TB) string {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), "mute.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		tb.Fatal(err)
	}
	var (
		mu    sync.Mutex
		conns []net.Conn
		wg    sync.WaitGroup
	)
	wg.Go(func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	})
	tb.Cleanup(func() {
		_ = l.Close()
		wg.Wait()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return path
}
