// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// RoleListenFlood is the attacker of StartListenFlood.
const RoleListenFlood = "listen-flood"

// floodNetnsEnv is how many netns the listen-flood helper makes.
const floodNetnsEnv = "AMBIENT_EBPF_FLOOD_NETNS"

// Unprivileged is the user StartListenFlood runs as: nobody.
const Unprivileged = 65534

// ListenersPerNetns is how many listeners the flood opens in each of its
// netns (AE_LISTENER_SLOTS: all that ae_listeners keeps per netns).
const ListenersPerNetns = 4

// StartListenFlood starts an unprivileged local user's attack on the
// node-wide listener table: as uid nobody, in a cgroup below the node's
// root (where the data path's socket hooks are), it makes a user
// namespace (which gives it CAP_NET_ADMIN over network namespaces of its
// own, and so SO_MARK), then netns new netns, and in each listens on
// ztunnel's inbound port with ztunnel's mark, ListenersPerNetns times
// (SO_REUSEPORT). It returns once every listener is up; they stay until
// the test ends. One process holds at most about 4000 netns (its
// RLIMIT_NOFILE): start several for more.
func (n *Node) StartListenFlood(netns int) *Process {
	n.t.Helper()
	bin := unprivilegedCopy(n.t)
	p := startProcess(n.t, "", n.cgroup("attacker"), &syscall.Credential{Uid: Unprivileged, Gid: Unprivileged, Groups: []uint32{}},
		"unshare", "--user", "--map-root-user", "--net", "--", "env", HelperEnv+"="+RoleListenFlood, floodNetnsEnv+"="+strconv.Itoa(netns), bin)
	want := fmt.Sprintf("listening %d\n", netns*ListenersPerNetns)
	for !strings.Contains(p.Output.String(), want) {
		if p.Exited() || strings.Contains(p.Output.String(), "helper:") {
			n.t.Fatalf("the listener flood failed:\n%s", p.Output.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return p
}

// unprivilegedCopy copies the test binary where nobody may run it (go
// test builds it in a directory only root can enter).
func unprivilegedCopy(t TB) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "lsn-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	bin := filepath.Join(dir, filepath.Base(self))
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(bin, os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		t.Fatal(err)
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
	return bin
}

// runListenFlood is the listen-flood role: it runs in its own user
// namespace (root there, nobody outside) and makes the netns and the
// listeners from one locked thread, whose netns each unshare replaces;
// a netns lives as long as its listeners. It holds them until SIGTERM.
func runListenFlood() error {
	count, err := strconv.Atoi(os.Getenv(floodNetnsEnv))
	if err != nil {
		return fmt.Errorf("%s: %w", floodNetnsEnv, err)
	}
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	runtime.LockOSThread() // never unlocked: the thread ends with the process
	listeners := 0
	for i := range count {
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("unshare netns %d: %w", i, err)
		}
		for range ListenersPerNetns {
			if err := markedListener(); err != nil {
				return fmt.Errorf("netns %d: %w", i, err)
			}
			listeners++
		}
	}
	fmt.Printf("listening %d\n", listeners)
	<-term
	return nil
}

// markedListener listens on [::]:15006 with ztunnel's mark, as ztunnel's
// inbound listener does; the descriptor stays open.
func markedListener() error {
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, 0x539); err != nil {
		return fmt.Errorf("setsockopt SO_MARK: %w", err)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
		return fmt.Errorf("setsockopt SO_REUSEPORT: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet6{Port: 15006}); err != nil {
		return fmt.Errorf("bind [::]:15006: %w", err)
	}
	if err := unix.Listen(fd, 16); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	return nil
}
