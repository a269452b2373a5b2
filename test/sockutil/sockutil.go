// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package sockutil makes sockets the way ztunnel and the test apps need
// them: in a chosen network namespace, with SO_MARK, SO_REUSEPORT,
// IP_TRANSPARENT and explicit source addresses, and never MPTCP unless asked
// (Opts.MPTCP). It also
// reads SO_ORIGINAL_DST the way ztunnel does.
package sockutil

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Opts are the socket options to set before bind/connect.
type Opts struct {
	Mark        int            // SO_MARK; 0 leaves it unset
	ReusePort   bool           // SO_REUSEPORT (and SO_REUSEADDR)
	Transparent bool           // IP_TRANSPARENT / IPV6_TRANSPARENT
	FreeBind    bool           // IP_FREEBIND
	V6Only      bool           // IPV6_V6ONLY on AF_INET6 sockets
	Bind        netip.AddrPort // local address; zero value: none
	Family      int            // AF_INET or AF_INET6; 0: from the address
	// MPTCP makes a Multipath TCP socket (IPPROTO_MPTCP), as Go's listeners
	// are by default where the kernel allows; stream sockets only.
	MPTCP bool
}

// Netns is a dedicated OS thread parked in a network namespace that makes
// sockets there. Sockets keep the namespace they were created in.
type Netns struct {
	reqs chan func()
	done chan struct{}
}

// EnterNetns starts a socket factory in the netns of f (a netns file).
// With f nil the factory uses the caller's current namespace.
func EnterNetns(f *os.File) (*Netns, error) {
	n := &Netns{reqs: make(chan func()), done: make(chan struct{})}
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is never unlocked: it exits with this goroutine, so no
		// other goroutine ever runs in the pod's namespace by accident.
		if f != nil {
			if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
				errc <- fmt.Errorf("setns: %w", err)
				return
			}
		}
		errc <- nil
		for {
			select {
			case fn := <-n.reqs:
				fn()
			case <-n.done:
				return
			}
		}
	}()
	if err := <-errc; err != nil {
		return nil, err
	}
	return n, nil
}

// Close stops the factory thread.
func (n *Netns) Close() { close(n.done) }

// Do runs fn on the thread inside the namespace.
func (n *Netns) Do(fn func() error) error {
	errc := make(chan error, 1)
	select {
	case n.reqs <- func() { errc <- fn() }:
	case <-n.done:
		return errors.New("netns factory closed")
	}
	return <-errc
}

func familyOf(a netip.Addr) int {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

// Socket creates a socket with opts applied (and bound when opts.Bind is
// set) inside the namespace.
func (n *Netns) Socket(family, typ int, opts Opts) (int, error) {
	var fd int
	err := n.Do(func() error {
		var err error
		fd, err = socket(family, typ, opts)
		return err
	})
	return fd, err
}

func socket(family, typ int, o Opts) (int, error) {
	proto := 0
	if o.MPTCP {
		proto = unix.IPPROTO_MPTCP
	}
	fd, err := unix.Socket(family, typ|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, proto)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	set := func(level, opt, v int, name string) error {
		if err := unix.SetsockoptInt(fd, level, opt, v); err != nil {
			return fmt.Errorf("setsockopt %s: %w", name, err)
		}
		return nil
	}
	var errs []error
	if o.Mark != 0 {
		errs = append(errs, set(unix.SOL_SOCKET, unix.SO_MARK, o.Mark, "SO_MARK"))
	}
	if o.ReusePort {
		errs = append(errs, set(unix.SOL_SOCKET, unix.SO_REUSEADDR, 1, "SO_REUSEADDR"), set(unix.SOL_SOCKET, unix.SO_REUSEPORT, 1, "SO_REUSEPORT"))
	}
	if family == unix.AF_INET6 {
		v6only := 0
		if o.V6Only {
			v6only = 1
		}
		errs = append(errs, set(unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, v6only, "IPV6_V6ONLY"))
	}
	if o.Transparent {
		errs = append(errs, set(unix.SOL_IP, unix.IP_TRANSPARENT, 1, "IP_TRANSPARENT"))
		if family == unix.AF_INET6 {
			errs = append(errs, set(unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1, "IPV6_TRANSPARENT"))
		}
	}
	if o.FreeBind {
		errs = append(errs, set(unix.SOL_IP, unix.IP_FREEBIND, 1, "IP_FREEBIND"))
		if family == unix.AF_INET6 {
			errs = append(errs, set(unix.SOL_IPV6, unix.IPV6_FREEBIND, 1, "IPV6_FREEBIND"))
		}
	}
	if err := errors.Join(errs...); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if o.Bind.IsValid() {
		if err := unix.Bind(fd, Sockaddr(family, o.Bind)); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("bind %s: %w", o.Bind, err)
		}
	}
	return fd, nil
}

// Sockaddr converts ap for a socket of the given family (IPv4 addresses
// become IPv4-mapped on AF_INET6 sockets).
func Sockaddr(family int, ap netip.AddrPort) unix.Sockaddr {
	if family == unix.AF_INET {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().Unmap().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

// Listen opens a TCP listener on addr in the namespace. Wildcard "::"
// listeners are dual-stack unless opts.V6Only.
func (n *Netns) Listen(addr netip.AddrPort, opts Opts) (net.Listener, error) {
	family := opts.Family
	if family == 0 {
		family = familyOf(addr.Addr())
	}
	opts.Bind = addr
	fd, err := n.Socket(family, unix.SOCK_STREAM, opts)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	if err := unix.Listen(fd, 1024); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("listen %s: %w", addr, err)
	}
	f := os.NewFile(uintptr(fd), "listener")
	defer f.Close()
	return net.FileListener(f)
}

// ListenUDP opens a UDP socket bound to addr in the namespace.
func (n *Netns) ListenUDP(addr netip.AddrPort, opts Opts) (*net.UDPConn, error) {
	family := opts.Family
	if family == 0 {
		family = familyOf(addr.Addr())
	}
	opts.Bind = addr
	fd, err := n.Socket(family, unix.SOCK_DGRAM, opts)
	if err != nil {
		return nil, fmt.Errorf("listen udp %s: %w", addr, err)
	}
	f := os.NewFile(uintptr(fd), "udp")
	defer f.Close()
	c, err := net.FilePacketConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}

// Dial connects a TCP socket made in the namespace to dst. The socket
// family follows opts.Family, else dst.
func (n *Netns) Dial(dst netip.AddrPort, opts Opts, timeout time.Duration) (net.Conn, error) {
	return n.dial(unix.SOCK_STREAM, dst, opts, timeout)
}

// DialUDP makes a connected UDP socket in the namespace.
func (n *Netns) DialUDP(dst netip.AddrPort, opts Opts) (net.Conn, error) {
	return n.dial(unix.SOCK_DGRAM, dst, opts, time.Second)
}

func (n *Netns) dial(typ int, dst netip.AddrPort, opts Opts, timeout time.Duration) (net.Conn, error) {
	family := opts.Family
	if family == 0 {
		family = familyOf(dst.Addr())
	}
	fd, err := n.Socket(family, typ, opts)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "conn")
	defer f.Close()
	if err := connect(f, Sockaddr(family, dst), timeout); err != nil {
		de := &DialError{Dst: dst, Err: err}
		if sa, serr := unix.Getsockname(fd); serr == nil {
			de.Local = SockaddrAddrPort(sa)
		}
		return nil, de
	}
	return net.FileConn(f)
}

// DialError is a failed connect. Local is the address the kernel picked
// for it, if it got that far: the client port tells a failed connection
// apart in conntrack, in captures and in the peer's records.
type DialError struct {
	Dst, Local netip.AddrPort
	Err        error
}

func (e *DialError) Error() string {
	if e.Local.Port() != 0 {
		return fmt.Sprintf("connect %s from %s: %v", e.Dst, e.Local, e.Err)
	}
	return fmt.Sprintf("connect %s: %v", e.Dst, e.Err)
}

func (e *DialError) Unwrap() error { return e.Err }

// connect runs a non-blocking connect through Go's poller.
func connect(f *os.File, sa unix.Sockaddr, timeout time.Duration) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var cerr error
	if err := rc.Control(func(fd uintptr) { cerr = unix.Connect(int(fd), sa) }); err != nil {
		return err
	}
	if cerr == nil {
		return nil
	}
	if !errors.Is(cerr, unix.EINPROGRESS) {
		return cerr
	}
	_ = f.SetWriteDeadline(time.Now().Add(timeout))
	defer f.SetWriteDeadline(time.Time{})
	first := true
	werr := rc.Write(func(fd uintptr) bool {
		soerr, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			cerr = err
			return true
		}
		if soerr != 0 {
			cerr = unix.Errno(soerr)
			return true
		}
		if _, err := unix.Getpeername(int(fd)); err != nil {
			if first {
				first = false
				return false // not writable yet: wait for the poller
			}
			cerr = err
			return true
		}
		cerr = nil
		return true
	})
	if werr != nil {
		return werr
	}
	return cerr
}

// AddrPort converts a socket address to netip form (IPv4-mapped addresses
// are unmapped).
func AddrPort(a net.Addr) netip.AddrPort {
	switch v := a.(type) {
	case *net.TCPAddr:
		return netip.AddrPortFrom(addrOf(v.IP), uint16(v.Port))
	case *net.UDPAddr:
		return netip.AddrPortFrom(addrOf(v.IP), uint16(v.Port))
	}
	return netip.AddrPort{}
}

// SockaddrAddrPort converts a raw socket address to netip form
// (IPv4-mapped addresses are unmapped); anything but IPv4 and IPv6 gives
// the zero AddrPort.
func SockaddrAddrPort(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port))
	}
	return netip.AddrPort{}
}

func addrOf(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

// OriginalDst asks the kernel for the connection's original destination
// the way ztunnel does: SO_ORIGINAL_DST on SOL_IP, then on SOL_IPV6. When
// both fail it returns the local address and from="local"; ztunnel does
// the same for transparent sockets.
func OriginalDst(c net.Conn) (dst netip.AddrPort, from string, err error) {
	sc, ok := c.(syscallConn)
	if !ok {
		return netip.AddrPort{}, "", errors.New("not a syscall conn")
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, "", err
	}
	var got netip.AddrPort
	_ = rc.Control(func(fd uintptr) {
		got, _ = OriginalDstFD(int(fd))
	})
	if got.IsValid() {
		return got, "SO_ORIGINAL_DST", nil
	}
	return AddrPort(c.LocalAddr()), "local", nil
}

// OriginalDstFD asks for the original destination of a connected socket
// as ztunnel does, SO_ORIGINAL_DST on SOL_IP, then on SOL_IPV6, without
// OriginalDst's fallback; the error is SOL_IP's.
func OriginalDstFD(fd int) (netip.AddrPort, error) {
	a, err := getOrigDst(fd, unix.SOL_IP)
	if err == nil {
		return a, nil
	}
	if a, err6 := getOrigDst(fd, unix.SOL_IPV6); err6 == nil {
		return a, nil
	}
	return netip.AddrPort{}, err
}

// OriginalDst4FD reads SO_ORIGINAL_DST at SOL_IP alone, the one call a
// proxy makes for an IPv4 connection.
func OriginalDst4FD(fd int) (netip.AddrPort, error) { return getOrigDst(fd, unix.SOL_IP) }

type syscallConn interface {
	SyscallConn() (syscall.RawConn, error)
}

// getOrigDst reads SO_ORIGINAL_DST (80) at level; the kernel answers with a
// sockaddr_in for SOL_IP and a sockaddr_in6 for SOL_IPV6.
func getOrigDst(fd, level int) (netip.AddrPort, error) {
	var buf [unix.SizeofSockaddrInet6]byte
	l := uint32(len(buf))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), 80,
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0)
	if errno != 0 {
		return netip.AddrPort{}, errno
	}
	port := uint16(buf[2])<<8 | uint16(buf[3])
	switch family := *(*uint16)(unsafe.Pointer(&buf[0])); {
	case family == unix.AF_INET && l >= unix.SizeofSockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(buf[4:8])), port), nil
	case family == unix.AF_INET6 && l >= unix.SizeofSockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(buf[8:24])).Unmap(), port), nil
	default:
		return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: unexpected family %d, length %d", family, l)
	}
}

// Forward relays each connection accepted on l (a listener of some netns)
// to target, dialled from the caller's netns, until l is closed: how a
// simulated node reaches the test's kube-apiserver on loopback.
func Forward(l net.Listener, target string) {
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				u, err := net.DialTimeout("tcp", target, 5*time.Second)
				if err != nil {
					return
				}
				defer u.Close()
				go func() { _, _ = io.Copy(u, c); _ = u.(*net.TCPConn).CloseWrite() }()
				_, _ = io.Copy(c, u)
			}()
		}
	}()
}
