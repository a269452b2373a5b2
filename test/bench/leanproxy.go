// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// leanProxy is the proxy of the lean paths (issue 15): ztunnel's socket
// contract and as little else as a relay can do, so that what a meshed
// connection costs beyond the direct path is mostly the redirection. Like
// ztunnel (and the stand-in) it is one process in the node netns serving
// every pod it is given, with its sockets in each pod's netns: wildcard
// dual-stack listeners on 15001 and 15006 with SO_MARK 0x539,
// SO_REUSEPORT and IP_TRANSPARENT; the original destination of every
// accepted connection by getsockopt(SO_ORIGINAL_DST), never a fallback;
// upstream sockets marked 0x539, plain TCP (never MPTCP), made in the
// netns of the listener that accepted (its one thread switches netns with
// setns only when the next upstream's pod differs); inbound ones bound to
// the client's address (IP_TRANSPARENT, the port left to connect by
// IP_BIND_ADDRESS_NO_PORT), as ztunnel keeps the original source. The
// thread runs a level-triggered epoll loop over non-blocking sockets and
// relays with read/write through one buffer: for the benchmark's 64-byte
// messages that is one copy each way and the fewest system calls (splice
// would need a pipe per direction and two calls per message). One
// process for both pods of a connection also spares a wake-up per hop: the
// outbound relay's write reaches the server pod's listener within the
// same system call, and the next epoll_wait returns it at once.
type leanProxy struct {
	epfd, wake int
	pods       map[string]*leanPod     // by name, fixed once serving
	listeners  map[int32]*leanListener // by fd, fixed once serving
	conns      []*leanConn             // by fd
	pool       []*leanConn
	gen        int32
	buf        []byte
	netns      int // the netns fd the loop thread is in (-1: the process's)
	done       chan struct{}
}

// leanPod is one pod served: its netns, and what the proxy did for it.
type leanPod struct {
	netns  int // an open fd of the pod's netns
	counts leanCounts
}

// leanCounts are what the proxy did for a pod, for the path checks.
type leanCounts struct {
	outbound, inbound, errors atomic.Int64
	lastError                 atomic.Value // string
}

// leanCountsReply is a snapshot of a pod's leanCounts.
type leanCountsReply struct {
	Outbound  int64  `json:"outbound"` // connections accepted on outbound listeners
	Inbound   int64  `json:"inbound"`  // on inbound listeners
	Errors    int64  `json:"errors"`   // connections it could not relay
	LastError string `json:"lastError,omitempty"`
}

// leanConn is one socket of a relayed pair.
type leanConn struct {
	fd         int
	gen        int32 // tells a reused fd's events from its predecessor's
	peer       *leanConn
	pod        *leanPod
	connecting bool   // upstream: connect in progress
	eof        bool   // its read side saw EOF (passed on to the peer)
	pending    []byte // read from the peer, not yet written here
	events     uint32 // the epoll interest registered
	added      bool   // in the epoll set
}

type leanRequest struct {
	Op    string `json:"op"` // add (before serve), serve, counts
	Pod   string `json:"pod,omitempty"`
	Netns string `json:"netns,omitempty"` // add: the pod's netns file
	// Listeners are the pod's listeners (add); none: ztunnel's (15001
	// outbound and 15006 inbound, original destination by
	// SO_ORIGINAL_DST).
	Listeners []leanListener `json:"listeners,omitempty"`
}

// leanListener is one listener of the lean proxy.
type leanListener struct {
	Port    uint16 `json:"port"`
	Inbound bool   `json:"inbound,omitempty"` // counted as inbound; with no To, bound to the client's address upstream
	// To is a fixed upstream for the connections of this listener,
	// addressed to the proxy explicitly: no original destination, and
	// the upstream socket gets the pod's own address (no transparent
	// bind) unless Contract. The direct+proxy baseline: the same relays,
	// no redirection.
	To netip.AddrPort `json:"to,omitzero"`
	// Contract, with To, has the listener do ztunnel's socket work all
	// the same: ask for the original destination (there is none without
	// redirection; the refusal is ignored) and, inbound, bind the
	// upstream to the client's address, whose replies a policy route in
	// the pod brings back. The direct+transparent baseline: what a meshed
	// connection costs beyond it is the redirection's alone.
	Contract bool `json:"contract,omitempty"`
	pod      *leanPod
}

func (p *leanProxy) handle(line []byte) (any, error) {
	req, err := decode[leanRequest](line)
	if err != nil {
		return nil, err
	}
	switch req.Op {
	case "add":
		if p.done != nil {
			return nil, errors.New("add pods before serving")
		}
		ls := req.Listeners
		if len(ls) == 0 {
			ls = []leanListener{{Port: standin.OutboundPort}, {Port: standin.InboundPort, Inbound: true}}
		}
		return nil, p.add(req.Pod, req.Netns, ls)
	case "serve":
		if p.done != nil {
			return nil, errors.New("already serving")
		}
		p.buf, p.netns, p.done = make([]byte, 64<<10), -1, make(chan struct{})
		go p.loop()
		return nil, nil
	case "counts":
		pod := p.pods[req.Pod]
		if pod == nil {
			return nil, fmt.Errorf("no pod %q", req.Pod)
		}
		c := leanCountsReply{Outbound: pod.counts.outbound.Load(), Inbound: pod.counts.inbound.Load(), Errors: pod.counts.errors.Load()}
		c.LastError, _ = pod.counts.lastError.Load().(string)
		return c, nil
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

// add opens a pod's listeners in its netns.
func (p *leanProxy) add(name, netnsPath string, ls []leanListener) error {
	if p.epfd == 0 {
		var err error
		if p.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
			return fmt.Errorf("epoll_create1: %w", err)
		}
		if p.wake, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
			return fmt.Errorf("eventfd: %w", err)
		}
		if err := p.register(p.wake, 0, unix.EPOLLIN); err != nil {
			return err
		}
		p.pods, p.listeners = map[string]*leanPod{}, map[int32]*leanListener{}
	}
	nsfd, err := unix.Open(netnsPath, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", netnsPath, err)
	}
	pod := &leanPod{netns: nsfd}
	p.pods[name] = pod
	f, err := os.Open(netnsPath)
	if err != nil {
		return err
	}
	defer f.Close()
	ns, err := sockutil.EnterNetns(f)
	if err != nil {
		return fmt.Errorf("pod %s: %w", name, err)
	}
	defer ns.Close()
	for _, l := range ls {
		fd, err := ns.Socket(unix.AF_INET6, unix.SOCK_STREAM, sockutil.Opts{Mark: standin.Mark, ReusePort: true, Transparent: true,
			Bind: netip.AddrPortFrom(netip.IPv6Unspecified(), l.Port)})
		if err != nil {
			return fmt.Errorf("pod %s: listener on %d: %w", name, l.Port, err)
		}
		if err := unix.Listen(fd, 4096); err != nil {
			unix.Close(fd)
			return fmt.Errorf("pod %s: listen on %d: %w", name, l.Port, err)
		}
		l.pod = pod
		p.listeners[int32(fd)] = &l
		if err := p.register(fd, 0, unix.EPOLLIN); err != nil {
			return err
		}
	}
	return nil
}

func (p *leanProxy) register(fd int, gen int32, events uint32) error {
	ev := unix.EpollEvent{Events: events, Fd: int32(fd), Pad: gen}
	if err := unix.EpollCtl(p.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return fmt.Errorf("epoll_ctl add %d: %w", fd, err)
	}
	return nil
}

// close stops the loop and closes every socket.
func (p *leanProxy) close() {
	if p.done != nil {
		_, _ = unix.Write(p.wake, []byte{1, 0, 0, 0, 0, 0, 0, 0})
		<-p.done
	}
	for fd := range p.listeners {
		unix.Close(int(fd))
	}
	for _, c := range p.conns {
		if c != nil {
			unix.Close(c.fd)
		}
	}
	for _, pod := range p.pods {
		unix.Close(pod.netns)
	}
	if p.epfd != 0 {
		unix.Close(p.wake)
		unix.Close(p.epfd)
	}
}

// loop is the proxy's one thread.
func (p *leanProxy) loop() {
	runtime.LockOSThread()
	defer close(p.done)
	events := make([]unix.EpollEvent, 256)
	for {
		n, err := unix.EpollWait(p.epfd, events, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			for _, pod := range p.pods {
				p.fail(pod, fmt.Errorf("epoll_wait: %w", err))
			}
			return
		}
		for _, ev := range events[:n] {
			switch l, listener := p.listeners[ev.Fd]; {
			case int(ev.Fd) == p.wake:
				return
			case listener:
				p.accept(int(ev.Fd), l)
			default:
				c := p.conn(int(ev.Fd))
				if c == nil || c.gen != ev.Pad {
					continue // closed earlier in this batch
				}
				p.ready(c, ev.Events)
			}
		}
	}
}

// accept takes every pending connection of a listener and connects its
// upstream.
func (p *leanProxy) accept(lfd int, l *leanListener) {
	for {
		fd, sa, err := unix.Accept4(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			return
		}
		if err != nil {
			p.fail(l.pod, fmt.Errorf("accept on %d: %w", l.Port, err))
			return
		}
		if l.Inbound {
			l.pod.counts.inbound.Add(1)
		} else {
			l.pod.counts.outbound.Add(1)
		}
		if err := p.open(fd, sa, l); err != nil {
			unix.Close(fd)
			p.fail(l.pod, err)
		}
	}
}

// open starts the upstream connection of an accepted socket; the
// downstream joins the loop once it is connected.
func (p *leanProxy) open(fd int, peer unix.Sockaddr, l *leanListener) error {
	dst := l.To
	switch {
	case l.Contract:
		_, _ = sockutil.OriginalDst4FD(fd) // the benchmark's traffic is IPv4
	case !dst.IsValid():
		var err error
		if dst, err = sockutil.OriginalDstFD(fd); err != nil {
			return fmt.Errorf("getsockopt SO_ORIGINAL_DST on :%d: %w", l.Port, err)
		}
		if dst.Port() == l.Port {
			return fmt.Errorf("original destination %s is a listener of ours", dst)
		}
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family := unix.AF_INET6
	if dst.Addr().Is4() {
		family = unix.AF_INET
	}
	if p.netns != l.pod.netns {
		if err := unix.Setns(l.pod.netns, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("setns: %w", err)
		}
		p.netns = l.pod.netns
	}
	up, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	if err := p.dial(up, family, dst, peer, l.Inbound && (!l.To.IsValid() || l.Contract)); err != nil {
		unix.Close(up)
		return err
	}
	down, upc := p.newConn(fd, l.pod), p.newConn(up, l.pod)
	down.peer, upc.peer, upc.connecting = upc, down, true
	if err := p.watch(upc, unix.EPOLLOUT); err != nil {
		p.release(down)
		p.release(upc)
		unix.Close(up)
		return err
	}
	return nil
}

// dial marks the upstream socket, with transparent binds it to the
// client's address (inbound delivery keeps the original source), and
// starts its connect.
func (p *leanProxy) dial(fd, family int, dst netip.AddrPort, peer unix.Sockaddr, transparent bool) error {
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, standin.Mark); err != nil {
		return fmt.Errorf("setsockopt SO_MARK: %w", err)
	}
	if transparent {
		src := sockutil.SockaddrAddrPort(peer).Addr()
		if !src.IsValid() {
			return fmt.Errorf("inbound connection from %v: no address", peer)
		}
		if src.Is4() != (family == unix.AF_INET) {
			return fmt.Errorf("inbound connection from %s to %s: families differ", src, dst)
		}
		for _, o := range [][2]int{{unix.SOL_IP, unix.IP_TRANSPARENT}, {unix.SOL_IP, unix.IP_BIND_ADDRESS_NO_PORT}} {
			if err := unix.SetsockoptInt(fd, o[0], o[1], 1); err != nil {
				return fmt.Errorf("setsockopt %d/%d: %w", o[0], o[1], err)
			}
		}
		if err := unix.Bind(fd, sockutil.Sockaddr(family, netip.AddrPortFrom(src, 0))); err != nil {
			return fmt.Errorf("bind %s: %w", src, err)
		}
	}
	if err := unix.Connect(fd, sockutil.Sockaddr(family, dst)); err != nil && !errors.Is(err, unix.EINPROGRESS) {
		return fmt.Errorf("connect %s: %w", dst, err)
	}
	return nil
}

// ready handles the events of one socket. Level-triggered epoll reports
// EPOLLERR and EPOLLHUP whatever the interest, so a socket that is not
// read (its read side done, or its peer's writes pending) and hangs up is
// closed here rather than reported again and again.
func (p *leanProxy) ready(c *leanConn, events uint32) {
	if c.connecting {
		if events&(unix.EPOLLERR|unix.EPOLLHUP) != 0 {
			errno, _ := unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_ERROR)
			p.closePair(c, fmt.Errorf("connect upstream: %w", unix.Errno(errno)))
			return
		}
		c.connecting = false
		if err := p.watch(c, unix.EPOLLIN); err != nil {
			p.closePair(c, err)
			return
		}
		if err := p.watch(c.peer, unix.EPOLLIN); err != nil {
			p.closePair(c, err)
		}
		return
	}
	if events&unix.EPOLLERR != 0 {
		p.closePair(c, nil) // a reset: the other side learns it from the close
		return
	}
	if events&unix.EPOLLOUT != 0 && len(c.pending) > 0 && !p.flush(c) {
		return
	}
	switch {
	case c.events&unix.EPOLLIN != 0 && events&(unix.EPOLLIN|unix.EPOLLHUP) != 0:
		p.relay(c)
	case events&unix.EPOLLHUP != 0:
		p.closePair(c, nil)
	}
}

// relay reads what c has and writes it to its peer; a partial write
// parks the rest on the peer and stops reading c until it is written.
func (p *leanProxy) relay(c *leanConn) {
	n, err := unix.Read(c.fd, p.buf)
	switch {
	case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
		return
	case err != nil:
		p.closePair(c, nil) // a reset: the other side learns it from the close
		return
	case n == 0:
		c.eof = true
		if err := p.watch(c, 0); err != nil {
			p.closePair(c, err)
			return
		}
		if c.peer.eof {
			p.closePair(c, nil)
			return
		}
		_ = unix.Shutdown(c.peer.fd, unix.SHUT_WR)
		return
	}
	w, err := unix.Write(c.peer.fd, p.buf[:n])
	if errors.Is(err, unix.EAGAIN) {
		w, err = 0, nil
	}
	if err != nil {
		p.closePair(c, nil)
		return
	}
	if w == n {
		return
	}
	c.peer.pending = append(c.peer.pending[:0], p.buf[w:n]...)
	if err := p.watch(c, 0); err != nil {
		p.closePair(c, err)
		return
	}
	if err := p.watch(c.peer, c.peer.events|unix.EPOLLOUT); err != nil {
		p.closePair(c, err)
	}
}

// flush writes c's pending bytes; once they are out, its peer is read
// again. It reports whether c is still open.
func (p *leanProxy) flush(c *leanConn) bool {
	w, err := unix.Write(c.fd, c.pending)
	if errors.Is(err, unix.EAGAIN) {
		return true
	}
	if err != nil {
		p.closePair(c, nil)
		return false
	}
	c.pending = c.pending[w:]
	if len(c.pending) > 0 {
		return true
	}
	if err := p.watch(c, c.events&^unix.EPOLLOUT); err != nil {
		p.closePair(c, err)
		return false
	}
	if !c.peer.eof {
		if err := p.watch(c.peer, unix.EPOLLIN); err != nil {
			p.closePair(c, err)
			return false
		}
	}
	return true
}

// watch sets c's epoll interest, adding c to the set the first time.
func (p *leanProxy) watch(c *leanConn, events uint32) error {
	op := unix.EPOLL_CTL_ADD
	if c.added {
		if events == c.events {
			return nil
		}
		op = unix.EPOLL_CTL_MOD
	}
	ev := unix.EpollEvent{Events: events, Fd: int32(c.fd), Pad: c.gen}
	if err := unix.EpollCtl(p.epfd, op, c.fd, &ev); err != nil {
		return fmt.Errorf("epoll_ctl %d: %w", c.fd, err)
	}
	c.events, c.added = events, true
	return nil
}

// closePair closes both sockets of a pair; err, when set, is counted as
// a connection the proxy could not relay.
func (p *leanProxy) closePair(c *leanConn, err error) {
	if err != nil {
		p.fail(c.pod, err)
	}
	for _, s := range []*leanConn{c, c.peer} {
		unix.Close(s.fd)
		p.release(s)
	}
}

func (p *leanProxy) fail(pod *leanPod, err error) {
	pod.counts.errors.Add(1)
	pod.counts.lastError.Store(err.Error())
}

func (p *leanProxy) newConn(fd int, pod *leanPod) *leanConn {
	var c *leanConn
	if n := len(p.pool); n > 0 {
		c, p.pool = p.pool[n-1], p.pool[:n-1]
	} else {
		c = &leanConn{}
	}
	p.gen++
	*c = leanConn{fd: fd, gen: p.gen, pod: pod, pending: c.pending[:0]}
	for fd >= len(p.conns) {
		p.conns = append(p.conns, make([]*leanConn, len(p.conns)+64)...)
	}
	p.conns[fd] = c
	return c
}

func (p *leanProxy) conn(fd int) *leanConn {
	if fd < 0 || fd >= len(p.conns) {
		return nil
	}
	return p.conns[fd]
}

func (p *leanProxy) release(c *leanConn) {
	if p.conns[c.fd] == c {
		p.conns[c.fd] = nil
	}
	p.pool = append(p.pool, c)
}
