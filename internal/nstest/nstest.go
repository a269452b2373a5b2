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
	"slices"
	"strconv"
	"strings"
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
	// The result is sent only after createNamed has returned, so its
	// deferred close of the original netns handle has run: a caller that
	// counts its descriptors right after NewNetns returns must not see that
	// handle, which would vanish later and look like a descriptor the code
	// under test closed.
	go func() { errc <- createNamed(name) }()
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

// createNamed creates the named netns on a thread of its own. On success
// the thread is back in its original netns and unlocked; on failure it
// stays locked, so the runtime discards it instead of reusing a thread in
// the wrong netns.
func createNamed(name string) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return fmt.Errorf("get current netns: %w", err)
	}
	defer orig.Close()
	h, err := netns.NewNamed(name)
	if err != nil {
		return fmt.Errorf("create netns %s: %w", name, err)
	}
	_ = h.Close()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("return to the original netns: %w", err)
	}
	runtime.UnlockOSThread()
	return nil
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
	return len(OpenFDs(tb))
}

// OpenFDs returns this process's open descriptors, each with what it refers
// to (the /proc/self/fd link), without the one used to read them.
func OpenFDs(tb testing.TB) map[string]string {
	tb.Helper()
	d, err := os.Open("/proc/self/fd")
	if err != nil {
		tb.Fatalf("open /proc/self/fd: %v", err)
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		tb.Fatalf("read /proc/self/fd: %v", err)
	}
	self := strconv.Itoa(int(d.Fd()))
	fds := make(map[string]string, len(names))
	for _, n := range names {
		if n == self {
			continue
		}
		target, err := os.Readlink("/proc/self/fd/" + n)
		if err != nil {
			target = "(closed while reading)"
		}
		fds[n] = target
	}
	return fds
}

// SameFDs fails tb unless this process has exactly the descriptors of
// before open, naming every one opened or closed since.
func SameFDs(tb testing.TB, before map[string]string) {
	tb.Helper()
	after := OpenFDs(tb)
	var diff []string
	for fd, target := range before {
		if after[fd] != target {
			diff = append(diff, fmt.Sprintf("closed %s (%s)", fd, target))
		}
	}
	for fd, target := range after {
		if before[fd] != target {
			diff = append(diff, fmt.Sprintf("opened %s (%s)", fd, target))
		}
	}
	if len(diff) > 0 {
		slices.Sort(diff)
		tb.Fatalf("descriptors: %d before, %d after: %s", len(before), len(after), strings.Join(diff, ", "))
	}
}
