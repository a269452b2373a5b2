// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package unixsock listens on the agent's unix sockets (ZDS, the CNI
// plugin's channel, the inspection API) without ever removing what is not
// ours and without a moment in which another user could connect.
//
// Before listening at a path, Listen looks at what is there:
//
//   - nothing: fine;
//   - a socket nobody listens on (connecting is refused): a stale socket of
//     a previous agent, removed;
//   - a socket a listener answers on (of any socket type): refused with
//     ErrInUse, left alone and working;
//   - anything else (a regular file, a directory, a symlink, a device):
//     refused with ErrNotSocket, left intact.
//
// The socket is owner-only from the start. Unix sockets get their mode at
// bind(2), from the process umask, and fchmod on a socket descriptor does
// not change the file; changing the umask is process-wide and races with
// every other goroutine creating files. So the socket is bound in a fresh
// 0700 directory next to path (only its owner can reach it there), made
// 0600, and then hard-linked to path: it appears at path already 0600, and
// link(2), unlike rename(2), fails instead of replacing a file that
// appeared at path in the meantime.
package unixsock

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

var (
	// ErrInUse: a listener answers on the socket at the path.
	ErrInUse = errors.New("in use by another listener")
	// ErrNotSocket: the path holds something other than a socket.
	ErrNotSocket = errors.New("not a socket")
)

// MaxPathLen is the longest socket path the kernel binds (sun_path less
// its terminating NUL).
const MaxPathLen = len(unix.RawSockaddrUnix{}.Path) - 1

// privatePattern names the private bind directory (os.MkdirTemp appends
// digits).
const privatePattern = ".sock"

// probeTimeout bounds the connect that tells a live socket from a stale
// one. Connecting to a unix socket does not wait for accept, so only a
// listener with a full backlog takes long, and that one is in use.
const probeTimeout = time.Second

// Check reports whether Listen could listen at path, changing nothing: nil
// when path is absent or a stale socket, and an error naming path when it
// is in use, not a socket, too long, relative, or under a non-directory.
// network is "unix" (stream) or "unixpacket" (seqpacket).
func Check(network, path string) error {
	_, err := inspect(network, path)
	return err
}

// Listen listens on network at path with a socket only its owner can use,
// after removing a stale socket there (see the package comment). The
// directory of path is created 0700 when missing.
func Listen(network, path string) (*Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create socket directory for %s: %w", path, err)
	}
	stale, err := inspect(network, path)
	if err != nil {
		return nil, err
	}
	if stale {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("remove stale socket %s: %w", path, err)
		}
	}
	private, err := os.MkdirTemp(dir, privatePattern)
	if err != nil {
		return nil, fmt.Errorf("create private directory for %s: %w", path, err)
	}
	defer os.RemoveAll(private)
	tmp := filepath.Join(private, "s")
	ul, err := bindIn(network, private)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	// The bound name goes with the private directory; Close removes the
	// name at path, and only while it is still this socket.
	ul.SetUnlinkOnClose(false)
	var st unix.Stat_t
	if err := errors.Join(unix.Chmod(tmp, 0o600), unix.Stat(tmp, &st)); err != nil {
		_ = ul.Close()
		return nil, fmt.Errorf("restrict socket %s to its owner: %w", path, err)
	}
	if err := os.Link(tmp, path); err != nil {
		_ = ul.Close()
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("socket %s: a file appeared there while listening: %w", path, err)
		}
		return nil, fmt.Errorf("move socket into place at %s: %w", path, err)
	}
	l := &Listener{UnixListener: ul, addr: &net.UnixAddr{Name: path, Net: network}, dev: st.Dev, ino: st.Ino}
	l.close = sync.OnceValue(l.doClose)
	return l, nil
}

// bindIn listens on a socket named "s" in dir. It binds through
// /proc/self/fd/<dir>/s, as systemd does for long paths, so the bind path
// is always short: only path itself must fit in a socket address, not the
// longer private path.
func bindIn(network, dir string) (*net.UnixListener, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	name := "/proc/self/fd/" + strconv.Itoa(fd) + "/s"
	return net.ListenUnix(network, &net.UnixAddr{Name: name, Net: network})
}

// Listener is a unix listener at its path. Its Close removes the socket
// file as long as it is still this socket (an agent that took over a
// path it found stale keeps it).
type Listener struct {
	*net.UnixListener
	addr     *net.UnixAddr
	dev, ino uint64
	close    func() error
}

// Addr is the path the listener was asked for (not the private path it
// was bound at).
func (l *Listener) Addr() net.Addr { return l.addr }

// Path is the socket's path.
func (l *Listener) Path() string { return l.addr.Name }

// Close stops listening and removes the socket file if it is still this
// socket. It may be called more than once and from several goroutines;
// every call returns once the socket is closed. (A second
// net.Listener.Close returns at once, possibly before the first has
// closed the descriptor.)
func (l *Listener) Close() error { return l.close() }

func (l *Listener) doClose() error {
	err := l.UnixListener.Close()
	var st unix.Stat_t
	if unix.Lstat(l.addr.Name, &st) == nil && st.Dev == l.dev && st.Ino == l.ino {
		if rerr := os.Remove(l.addr.Name); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			err = errors.Join(err, fmt.Errorf("remove socket %s: %w", l.addr.Name, rerr))
		}
	}
	return err
}

// inspect checks path for Listen and reports whether it is a stale socket.
func inspect(network, path string) (stale bool, err error) {
	switch {
	case network != "unix" && network != "unixpacket":
		return false, fmt.Errorf("socket %s: unsupported network %q", path, network)
	case !filepath.IsAbs(path):
		return false, fmt.Errorf("socket path %q is not absolute", path)
	case len(path) > MaxPathLen:
		return false, fmt.Errorf("socket path %s is %d bytes, longer than the %d a socket can have", path, len(path), MaxPathLen)
	case filepath.Base(path) == string(filepath.Separator):
		return false, fmt.Errorf("socket path %q names no file", path)
	}
	if err := checkParents(path); err != nil {
		return false, err
	}
	fi, err := os.Lstat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("socket %s: %w", path, err)
	case fi.Mode().Type() != fs.ModeSocket:
		return false, fmt.Errorf("%s is %s, not a socket; refusing to replace it: %w", path, describe(fi.Mode()), ErrNotSocket)
	}
	c, err := net.DialTimeout(network, path, probeTimeout)
	switch {
	case err == nil:
		_ = c.Close()
		return false, fmt.Errorf("socket %s is %w", path, ErrInUse)
	case errors.Is(err, syscall.ECONNREFUSED):
		return true, nil // nobody listens: a dead agent's socket
	case errors.Is(err, syscall.ENOENT):
		return false, nil // removed since the Lstat
	case errors.Is(err, syscall.EPROTOTYPE):
		return false, fmt.Errorf("socket %s is %w (of another socket type)", path, ErrInUse)
	}
	// A full backlog (EAGAIN), a timeout, a permission problem: something
	// is there that we cannot prove dead, so it stays.
	return false, fmt.Errorf("socket %s: cannot tell whether it is in use, leaving it: %w", path, err)
}

// checkParents requires the nearest existing ancestor of path to be a
// directory (symlinks to directories, like /var/run, are fine), so a path
// under a regular file fails here and not at MkdirAll or bind.
func checkParents(path string) error {
	for dir := filepath.Dir(path); ; dir = filepath.Dir(dir) {
		fi, err := os.Stat(dir)
		switch {
		case err == nil && fi.IsDir():
			return nil
		case err == nil:
			return fmt.Errorf("socket %s: %s is %s, not a directory", path, dir, describe(fi.Mode()))
		case !errors.Is(err, fs.ErrNotExist):
			return fmt.Errorf("socket %s: %w", path, err)
		}
		if dir == filepath.Dir(dir) {
			return nil
		}
	}
}

// describe names a file type for errors.
func describe(m fs.FileMode) string {
	switch m.Type() {
	case 0:
		return "a regular file"
	case fs.ModeDir:
		return "a directory"
	case fs.ModeSymlink:
		return "a symlink"
	case fs.ModeNamedPipe:
		return "a named pipe"
	case fs.ModeDevice:
		return "a block device"
	case fs.ModeDevice | fs.ModeCharDevice:
		return "a character device"
	case fs.ModeSocket:
		return "a socket"
	}
	return "a file of type " + m.Type().String()
}
