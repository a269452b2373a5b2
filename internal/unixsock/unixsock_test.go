// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package unixsock

import (
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

var networks = []string{"unix", "unixpacket"}

func listen(t *testing.T, network, path string) *Listener {
	t.Helper()
	l, err := Listen(network, path)
	if err != nil {
		t.Fatalf("Listen %s %s: %v", network, path, err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// rawListener binds path directly, as another program would.
func rawListener(t *testing.T, network, path string) *net.UnixListener {
	t.Helper()
	l, err := net.ListenUnix(network, &net.UnixAddr{Name: path, Net: network})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// staleSocket leaves a socket file nobody listens on, as a killed agent does.
func staleSocket(t *testing.T, network, path string) {
	t.Helper()
	l := rawListener(t, network, path)
	l.SetUnlinkOnClose(false)
	_ = l.Close()
}

// answers checks that l accepts a connection dialled at path.
func answers(t *testing.T, network, path string, l interface{ Accept() (net.Conn, error) }) {
	t.Helper()
	accepted := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			_ = c.Close()
		}
		accepted <- err
	}()
	c, err := net.Dial(network, path)
	if err != nil {
		t.Fatalf("dial %s: %v", path, err)
	}
	_ = c.Close()
	if err := <-accepted; err != nil {
		t.Fatalf("accept on %s: %v", path, err)
	}
}

func TestListenCreatesAnOwnerOnlySocketAndRemovesItOnClose(t *testing.T) {
	for _, network := range networks {
		t.Run(network, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "run", "agent")
			path := filepath.Join(dir, "agent.sock")
			l := listen(t, network, path)
			fi, err := os.Lstat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Type() != fs.ModeSocket || fi.Mode().Perm() != 0o600 {
				t.Errorf("socket mode %v, want a 0600 socket", fi.Mode())
			}
			if di, err := os.Stat(dir); err != nil || di.Mode().Perm() != 0o700 {
				t.Errorf("created directory: %v, %v; want 0700", di.Mode(), err)
			}
			if l.Addr().String() != path || l.Path() != path {
				t.Errorf("Addr %v, Path %s; want %s", l.Addr(), l.Path(), path)
			}
			answers(t, network, path, l)
			ents, _ := os.ReadDir(dir)
			if len(ents) != 1 {
				t.Errorf("directory holds %v, want only the socket", ents)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("socket left after Close: %v", err)
			}
		})
	}
}

// TestSocketIsOwnerOnlyWheneverVisible watches the directory while Listen
// runs: whatever appears at the path, and whatever else appears in the
// directory, is never reachable by another user.
func TestSocketIsOwnerOnlyWheneverVisible(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.sock")
	for i := range 20 {
		var stop atomic.Bool
		var wg sync.WaitGroup
		var bad []string
		wg.Go(func() {
			for !stop.Load() {
				ents, _ := os.ReadDir(dir)
				for _, e := range ents {
					fi, err := os.Lstat(filepath.Join(dir, e.Name()))
					if err != nil {
						continue // gone meanwhile
					}
					switch {
					case e.Name() == "agent.sock" && fi.Mode() != fs.ModeSocket|0o600:
						bad = append(bad, "socket "+fi.Mode().String())
					case strings.HasPrefix(e.Name(), privatePattern) && fi.Mode() != fs.ModeDir|0o700:
						bad = append(bad, "private directory "+fi.Mode().String())
					}
				}
			}
		})
		l, err := Listen("unix", path)
		stop.Store(true)
		wg.Wait()
		if err != nil {
			t.Fatal(err)
		}
		_ = l.Close()
		if len(bad) > 0 {
			t.Fatalf("round %d: seen %v", i, bad)
		}
	}
}

// TestListenRefusesWhatIsNotAStaleSocket: a regular file, a directory, a
// symlink (even to a socket) or a socket someone listens on stays exactly
// as it was, and the error names the path and what is there.
func TestListenRefusesWhatIsNotAStaleSocket(t *testing.T) {
	for _, network := range networks {
		t.Run(network, func(t *testing.T) {
			t.Run("regular file", func(t *testing.T) {
				path := filepath.Join(t.TempDir(), "agent.sock")
				if err := os.WriteFile(path, []byte("keep me"), 0o644); err != nil {
					t.Fatal(err)
				}
				_, err := Listen(network, path)
				if !errors.Is(err, ErrNotSocket) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "regular file") {
					t.Fatalf("Listen over a regular file: %v", err)
				}
				if b, err := os.ReadFile(path); err != nil || string(b) != "keep me" {
					t.Fatalf("the file is now %q, %v", b, err)
				}
			})
			t.Run("directory", func(t *testing.T) {
				path := filepath.Join(t.TempDir(), "agent.sock")
				if err := os.Mkdir(path, 0o700); err != nil {
					t.Fatal(err)
				}
				if _, err := Listen(network, path); !errors.Is(err, ErrNotSocket) || !strings.Contains(err.Error(), "directory") {
					t.Fatalf("Listen over a directory: %v", err)
				}
				if fi, err := os.Lstat(path); err != nil || !fi.IsDir() {
					t.Fatalf("the directory is gone: %v", err)
				}
			})
			t.Run("symlink to a live socket", func(t *testing.T) {
				dir := t.TempDir()
				target, path := filepath.Join(dir, "real.sock"), filepath.Join(dir, "agent.sock")
				other := rawListener(t, network, target)
				if err := os.Symlink(target, path); err != nil {
					t.Fatal(err)
				}
				if _, err := Listen(network, path); !errors.Is(err, ErrNotSocket) || !strings.Contains(err.Error(), "symlink") {
					t.Fatalf("Listen over a symlink: %v", err)
				}
				if got, err := os.Readlink(path); err != nil || got != target {
					t.Fatalf("symlink now %q, %v", got, err)
				}
				answers(t, network, target, other)
			})
			for _, otherNet := range networks {
				t.Run("live "+otherNet+" listener", func(t *testing.T) {
					path := filepath.Join(t.TempDir(), "agent.sock")
					other := rawListener(t, otherNet, path)
					_, err := Listen(network, path)
					if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), "socket "+path+" is in use by another listener") {
						t.Fatalf("Listen over a live socket: %v", err)
					}
					answers(t, otherNet, path, other)
				})
			}
			t.Run("live listener of ours", func(t *testing.T) {
				path := filepath.Join(t.TempDir(), "agent.sock")
				first := listen(t, network, path)
				if _, err := Listen(network, path); !errors.Is(err, ErrInUse) {
					t.Fatalf("second Listen: %v", err)
				}
				answers(t, network, path, first)
			})
		})
	}
}

func TestListenReplacesAStaleSocket(t *testing.T) {
	for _, network := range networks {
		t.Run(network, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "agent.sock")
			staleSocket(t, network, path)
			if err := Check(network, path); err != nil {
				t.Fatalf("Check on a stale socket: %v", err)
			}
			if _, err := os.Lstat(path); err != nil {
				t.Fatalf("Check changed the path: %v", err)
			}
			l := listen(t, network, path)
			answers(t, network, path, l)
		})
	}
}

// TestCloseKeepsASocketThatReplacedOurs: when the path has become another
// socket (a newer agent found ours stale), closing ours leaves it.
func TestCloseKeepsASocketThatReplacedOurs(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	old := listen(t, "unix", path)
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	newer := listen(t, "unix", path)
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	answers(t, "unix", path, newer)
}

// TestConcurrentCloseWaitsForTheSocket: every Close returns only once the
// socket is closed and its file removed, whichever call did the work.
func TestConcurrentCloseWaitsForTheSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	for range 50 {
		l := listen(t, "unixpacket", path)
		accepting := make(chan struct{})
		go func() {
			close(accepting)
			_, _ = l.Accept()
		}()
		<-accepting
		var wg sync.WaitGroup
		for range 3 {
			wg.Go(func() {
				_ = l.Close()
				if _, err := net.Dial("unixpacket", path); err == nil || !(errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)) {
					t.Errorf("dial after Close: %v", err)
				}
			})
		}
		wg.Wait()
	}
}

// TestLongPathsBindWhileTheyFit: a path as long as a socket address allows
// binds, although the private bind directory next to it is longer.
func TestLongPathsBindWhileTheyFit(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, strings.Repeat("d", MaxPathLen-len(dir)-len("//agent.sock")), "agent.sock")
	if len(path) != MaxPathLen {
		t.Fatalf("path of %d bytes", len(path))
	}
	l := listen(t, "unix", path)
	answers(t, "unix", path, l)
}

func TestCheckRefusesBadPaths(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct{ path, want string }{
		"relative":     {"run/agent.sock", "not absolute"},
		"too long":     {"/" + strings.Repeat("a", MaxPathLen), "longer than"},
		"under a file": {filepath.Join(file, "sub", "agent.sock"), "not a directory"},
		"root":         {"/", "names no file"},
	} {
		t.Run(name, func(t *testing.T) {
			err := Check("unix", tc.path)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Check(%q): %v, want %q", tc.path, err, tc.want)
			}
			if _, err := Listen("unix", tc.path); err == nil {
				t.Fatalf("Listen(%q) succeeded", tc.path)
			}
		})
	}
	if err := Check("unix", filepath.Join(dir, "missing", "agent.sock")); err != nil {
		t.Errorf("Check under a missing directory: %v", err)
	}
}
