// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package nsexec

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// Do runs fn on an OS thread switched into the network namespace at
// path. Network namespaces are per thread: the thread is locked for the
// duration, and if it cannot be switched back it is never unlocked, so Go
// retires it instead of reusing a thread in the wrong namespace.
func Do(path string, fn func() error) error {
	target, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer target.Close()

	// The result is sent once switchTo has returned, with its handle
	// of the thread's own netns closed: the caller sees no descriptor
	// that is about to go.
	errc := make(chan error, 1)
	go func() { errc <- switchTo(path, target, fn) }()
	return <-errc
}

// switchTo runs fn on the calling goroutine's thread switched into
// target, and switches back; see Do.
func switchTo(path string, target *os.File, fn func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open current netns: %w", err)
	}
	defer orig.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("setns %s: %w", path, err)
	}
	ferr := fn()
	if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("setns back from %s: %w", path, err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// Cookie returns the cookie of the calling thread's netns, the
// same value bpf_get_netns_cookie() gives the programs (Linux 5.14).
func Cookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	if err != nil {
		return 0, fmt.Errorf("getsockopt SO_NETNS_COOKIE: %w", err)
	}
	return cookie, nil
}

// IfindexByName resolves an interface of the calling thread's netns with
// one SIOCGIFINDEX ioctl. net.InterfaceByName dumps every link instead,
// which in a node netns with a thousand pod veths dominated enrollment.
func IfindexByName(name string) (int, error) {
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return 0, fmt.Errorf("interface name %q: %w", name, err)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFINDEX, ifr); err != nil {
		return 0, fmt.Errorf("SIOCGIFINDEX %s: %w", name, err)
	}
	return int(ifr.Uint32()), nil
}

// OnInterface resolves iface inside the netns at path and runs fn there
// with its index.
func OnInterface(path, iface string, fn func(ifindex int) error) error {
	return Do(path, func() error {
		index, err := IfindexByName(iface)
		if err != nil {
			return fmt.Errorf("find interface %s: %w", iface, err)
		}
		return fn(index)
	})
}
