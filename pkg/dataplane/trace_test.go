// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func traceFlag(t *testing.T, n *simnode.Node) uint32 {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", bpfobj.TraceFlagMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var on uint32
	if err := m.Lookup(uint32(0), &on); err != nil {
		t.Fatal(err)
	}
	return on
}

func setTraceFlag(t *testing.T, n *simnode.Node, on uint32) {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", bpfobj.TraceFlagMap), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Put(uint32(0), on); err != nil {
		t.Fatal(err)
	}
}

// The programs' flag is on exactly while a tracer is open; one tracer at
// a time; a restarted agent keeps a live tracer's flag and switches off
// one a dead tracer left on.
func TestTracingIsOnOnlyWhileATracerIsOpen(t *testing.T) {
	n := simnode.New(t)
	d := newDataplane(t, n)
	if on := traceFlag(t, n); on != 0 {
		t.Fatalf("flag %d with nobody tracing", on)
	}
	tr, err := inspect.OpenTracer(n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	if on := traceFlag(t, n); on != 1 {
		t.Errorf("flag %d while tracing", on)
	}
	if _, err := inspect.OpenTracer(n.BPFFSDir); !errors.Is(err, inspect.ErrTraceBusy) {
		t.Errorf("a second tracer: %v, want inspect.ErrTraceBusy", err)
	}
	// An agent restarting under a live tracer keeps the events on.
	d.Close()
	d = newDataplane(t, n)
	if on := traceFlag(t, n); on != 1 {
		t.Errorf("flag %d after a restart under a live tracer", on)
	}
	done := make(chan error, 1)
	go func() { _, err := tr.Read(); done <- err }()
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, os.ErrClosed) {
		t.Errorf("Read blocked across Close returned %v, want os.ErrClosed", err)
	}
	if on := traceFlag(t, n); on != 0 {
		t.Errorf("flag %d after Close", on)
	}
	if err := tr.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
	// A tracer that died (no lock held) left the flag on.
	setTraceFlag(t, n, 1)
	d.Close()
	newDataplane(t, n)
	if on := traceFlag(t, n); on != 0 {
		t.Errorf("flag %d after a restart with no tracer", on)
	}
	if _, err := inspect.OpenTracer(t.TempDir()); !errors.Is(err, inspect.ErrNotInstalled) {
		t.Errorf("a tracer of nothing pinned: %v, want inspect.ErrNotInstalled", err)
	}
}
