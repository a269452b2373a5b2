// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package nstest creates throwaway named network namespaces for tests and
// tells descriptors apart the way ztunnel does, by (device, inode) (Z9).
package nstest

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// NewNetns creates a named netns with a unique name, removes it when the
// test ends (pass or fail) and returns its path. It needs root.
func NewNetns(tb testing.TB) string {
	tb.Helper()
	testenv.RequireRoot(tb)
	name := "zds-" + testenv.RunID()
	errc := make(chan error, 1)
	go func() {
		// The thread switches netns; on any failure it stays locked, so the
		// runtime discards it instead of reusing a thread in the wrong netns.
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- fmt.Errorf("get current netns: %w", err)
			return
		}
		defer orig.Close()
		h, err := netns.NewNamed(name)
		if err != nil {
			errc <- fmt.Errorf("create netns %s: %w", name, err)
			return
		}
		_ = h.Close()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("return to the original netns: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- nil
	}()
	tb.Cleanup(func() {
		if err := netns.DeleteNamed(name); err != nil && !os.IsNotExist(err) {
			tb.Errorf("delete netns %s: %v", name, err)
		}
	})
	if err := <-errc; err != nil {
		tb.Fatal(err)
	}
	return filepath.Join("/var/run/netns", name)
}

// Ident is a namespace's identity: (device, inode).
type Ident struct{ Dev, Ino uint64 }

// IdentOfPath returns the identity of the file at path.
func IdentOfPath(tb testing.TB, path string) Ident {
	tb.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		tb.Fatalf("stat %s: %v", path, err)
	}
	return Ident{Dev: st.Dev, Ino: st.Ino}
}

// IdentOfFD returns the identity of the file behind fd.
func IdentOfFD(tb testing.TB, fd int) Ident {
	tb.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		tb.Fatalf("fstat %d: %v", fd, err)
	}
	return Ident{Dev: st.Dev, Ino: st.Ino}
}

// CountFDs returns how many descriptors this process has open.
func CountFDs(tb testing.TB) int {
	tb.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatalf("read /proc/self/fd: %v", err)
	}
	return len(ents) - 1 // the directory being read
}
