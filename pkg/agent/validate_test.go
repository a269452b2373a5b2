// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// node is a temp directory laid out like a node: the agent's sockets,
// its pin directory and a pod file.
type node struct {
	dir, zds, cni, inspect, bpffs, pods string
}

func newNode(t *testing.T) node {
	t.Helper()
	dir := t.TempDir()
	n := node{dir: dir, zds: filepath.Join(dir, "ztunnel", "ztunnel.sock"), cni: filepath.Join(dir, "run", "cni.sock"),
		inspect: filepath.Join(dir, "run", "inspect.sock"), bpffs: filepath.Join(dir, "bpf", "ambient-ebpf"), pods: filepath.Join(dir, "pods.yaml")}
	if err := os.WriteFile(n.pods, []byte("apiVersion: v1\nkind: List\nitems: []\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return n
}

// args are the flags of an agent on n with overrides appended (the flag
// package keeps the last value).
func (n node) args(overrides ...string) []string {
	return append([]string{"--node-name", "n1", "--standalone-pods", n.pods, "--install-cni=false", "--bpffs-dir", n.bpffs,
		"--zds-socket", n.zds, "--cni-socket", n.cni, "--inspect-socket", n.inspect,
		"--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"}, overrides...)
}

func listenAt(t *testing.T, network, path string) net.Listener {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen(network, path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// TestStartRefusesBadPathsBeforeTouchingTheKernel: a socket path that is
// not free, a pod file that is not one, or a bad listen address stops Run
// before anything is created, with an error naming the flag and the path,
// and what is at the path is left as it was.
func TestStartRefusesBadPathsBeforeTouchingTheKernel(t *testing.T) {
	cases := []struct {
		name  string
		setup func(t *testing.T, n node) (args []string, want []string, intact func(t *testing.T))
	}{
		{"cni socket on a regular file", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			file := filepath.Join(n.dir, "notes.txt")
			if err := os.WriteFile(file, []byte("keep"), 0o600); err != nil {
				t.Fatal(err)
			}
			return []string{"--cni-socket", file}, []string{"--cni-socket", file, "regular file"}, func(t *testing.T) {
				if b, err := os.ReadFile(file); err != nil || string(b) != "keep" {
					t.Errorf("the file is now %q, %v", b, err)
				}
			}
		}},
		{"inspect socket on a directory", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--inspect-socket", n.dir}, []string{"--inspect-socket", n.dir, "directory"}, func(*testing.T) {}
		}},
		{"cni socket on ztunnel's live socket", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			zt := filepath.Join(n.dir, "live", "ztunnel.sock")
			l := listenAt(t, "unixpacket", zt)
			return []string{"--cni-socket", zt}, []string{"--cni-socket", "socket " + zt + " is in use by another listener"}, func(t *testing.T) {
				go func() {
					if c, err := l.Accept(); err == nil {
						_ = c.Close()
					}
				}()
				c, err := net.Dial("unixpacket", zt)
				if err != nil {
					t.Errorf("ztunnel's socket no longer answers: %v", err)
					return
				}
				_ = c.Close()
			}
		}},
		{"zds socket in use by another agent", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			listenAt(t, "unixpacket", n.zds)
			return nil, []string{"--zds-socket", n.zds, "in use"}, func(*testing.T) {}
		}},
		{"two flags, one socket", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--inspect-socket", n.cni}, []string{"--inspect-socket " + n.cni + ": the same socket as --cni-socket"}, func(*testing.T) {}
		}},
		{"relative socket path", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--zds-socket", "ztunnel.sock"}, []string{"--zds-socket", `"ztunnel.sock" is not absolute`}, func(*testing.T) {}
		}},
		{"socket under a regular file", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			path := filepath.Join(n.pods, "cni.sock")
			return []string{"--cni-socket", path}, []string{"--cni-socket", path, "not a directory"}, func(*testing.T) {}
		}},
		{"missing pod file", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			path := filepath.Join(n.dir, "missing.yaml")
			return []string{"--standalone-pods", path}, []string{"--standalone-pods " + path, "no such file"}, func(*testing.T) {}
		}},
		{"pod file is a directory", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--standalone-pods", n.dir}, []string{"--standalone-pods " + n.dir, "not a regular file"}, func(*testing.T) {}
		}},
		{"health address without a port", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--health-addr", "127.0.0.1"}, []string{`--health-addr "127.0.0.1"`, "missing port"}, func(*testing.T) {}
		}},
		{"metrics address with a host name", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--metrics-addr", "metrics.example:15014"}, []string{`--metrics-addr "metrics.example:15014"`, "not an IP address"}, func(*testing.T) {}
		}},
		{"metrics address with a bad port", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--metrics-addr", ":99999"}, []string{`--metrics-addr ":99999"`, "port"}, func(*testing.T) {}
		}},
		{"health and metrics on one address", func(t *testing.T, n node) ([]string, []string, func(*testing.T)) {
			return []string{"--health-addr", ":15014", "--metrics-addr", ":15014"}, []string{"--health-addr and --metrics-addr are both"}, func(*testing.T) {}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t)
			overrides, want, intact := tc.setup(t, n)
			cfg, err := parse(t, n.args(overrides...)...)
			if err != nil {
				t.Fatalf("flags: %v", err)
			}
			// Cancelled: should validation ever let a case through, Run
			// stops at its first wait instead of loading anything.
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			err = Run(ctx, cfg)
			if err == nil {
				t.Fatal("Run accepted the configuration")
			}
			for _, w := range want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("Run: %v\nwant it to say %q", err, w)
				}
			}
			for _, dir := range []string{filepath.Dir(n.bpffs), filepath.Dir(n.cni)} {
				if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s exists after a refused start: %v", dir, err)
				}
			}
			intact(t)
		})
	}
}

// TestValidateAcceptsFreeAndStalePathsAndChangesNothing: absent sockets
// (in directories yet to be made) and a dead agent's stale socket pass;
// validation neither creates nor removes anything.
func TestValidateAcceptsFreeAndStalePathsAndChangesNothing(t *testing.T) {
	n := newNode(t)
	stale := listenAt(t, "unix", n.cni).(*net.UnixListener)
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()
	cfg, err := parse(t, n.args()...)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	if err := cfg.validate(); err != nil {
		t.Fatalf("validate: %v", err)
	}
	if fi, err := os.Lstat(n.cni); err != nil || fi.Mode().Type() != os.ModeSocket {
		t.Errorf("stale socket touched: %v", err)
	}
	for _, p := range []string{filepath.Dir(n.zds), n.inspect, filepath.Dir(n.bpffs)} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("validate created %s", p)
		}
	}
}
