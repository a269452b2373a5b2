// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// Helper roles.
const (
	RoleApp     = "app"
	RoleZtunnel = "ztunnel"
)

// RecordsEnv names the file the ztunnel helper appends its records to.
const RecordsEnv = "AMBIENT_EBPF_RECORDS"

// TranscriptEnv names the file the ztunnel helper appends each ZDS request
// it receives to (zdsclient.Observed, one JSON line each).
const TranscriptEnv = "AMBIENT_EBPF_ZDS_TRANSCRIPT"

// The stand-in's DNS table in the simulated node: names under
// KnownDNSSuffix are answered by ztunnel itself, the rest go upstream to
// the outside host's server, which answers everything with OutsideDNSAnswer.
var (
	KnownDNSSuffix   = "known.test"
	KnownDNSAnswer   = netip.MustParseAddr("198.18.250.1")
	OutsideDNSAnswer = netip.MustParseAddr("198.19.0.53")
)

// RunHelper runs the helper role named in the environment, if any, and
// exits. Call it first thing in TestMain.
func RunHelper() {
	role := os.Getenv(HelperEnv)
	if role == "" {
		return
	}
	var err error
	switch role {
	case RoleApp:
		err = serveJSON(newApp())
	case RoleZtunnel:
		err = runZtunnel()
	case RoleListenFlood:
		err = runListenFlood()
	default:
		err = fmt.Errorf("unknown helper role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// AppRequest is a command for the app helper.
type AppRequest struct {
	Op     string         `json:"op"` // listen-tcp, listen-udp, dial-tcp, dial-udp
	Name   string         `json:"name,omitempty"`
	Addr   netip.AddrPort `json:"addr"`
	Mark   int            `json:"mark,omitempty"`
	Mapped bool           `json:"mapped,omitempty"` // dial from AF_INET6 to ::ffff:a.b.c.d
	Bind   netip.AddrPort `json:"bind,omitempty"`
	// Transparent makes ops dial-tcp and dial-udp bind to Bind's address
	// whether or not it is local (IP_TRANSPARENT and IP_FREEBIND), as
	// ztunnel does to deliver from the client's address.
	Transparent bool `json:"transparent,omitempty"`
	// Timeout bounds the connect of op stream-open (default 5 s) and of
	// op dial-tcp (default 3 s): a dial that is meant to fail need not
	// wait the default out.
	Timeout time.Duration `json:"timeout,omitempty"`
	// DNS: the name to query (op dns) or the address every query is
	// answered with (op dns-server); Proto udp or tcp; Connected uses a
	// connected UDP socket.
	DNSName   string     `json:"dnsName,omitempty"`
	Answer    netip.Addr `json:"answer,omitzero"`
	Proto     string     `json:"proto,omitempty"`
	Connected bool       `json:"connected,omitempty"`
	// Count is the number of concurrent connections of op dial-many.
	Count int `json:"count,omitempty"`
	// WaitEOF makes dial-tcp read until the server closes before closing:
	// the server side closes first (and keeps the TIME_WAIT).
	WaitEOF bool `json:"waitEOF,omitempty"`
	// Bytes is how much op bulk-tcp sends (in writes of varying sizes)
	// before it half-closes and reads the echo back to EOF.
	Bytes int `json:"bytes,omitempty"`
	// ReadWrite makes op listen-echo copy with read and write; by
	// default it splices (io.Copy from a TCP connection to itself).
	ReadWrite bool `json:"readWrite,omitempty"`
	// MPTCP makes ops listen-echo and bulk-tcp use Multipath TCP sockets.
	MPTCP bool `json:"mptcp,omitempty"`
}

// AppResponse answers an AppRequest.
type AppResponse struct {
	OK    bool           `json:"ok"`
	Err   string         `json:"err,omitempty"`
	Reply *standin.Reply `json:"reply,omitempty"`
	Local netip.AddrPort `json:"local,omitzero"`
	// Remote is the peer a dial's socket names (getpeername(2)), or the
	// client of op accept-orig-dst.
	Remote netip.AddrPort `json:"remote,omitzero"`
	// OrigDst is what SO_ORIGINAL_DST answered op accept-orig-dst.
	OrigDst netip.AddrPort `json:"origDst,omitzero"`
	// Start is when a dial began (ops dial-tcp and dial-udp): the
	// stand-in's record of that connection is made after it, while client
	// ports come back over a run (Ztunnel.RecordSince).
	Start time.Time `json:"start,omitzero"`
	// DNS: the answered address and where the reply came from as the app
	// sees it (recvfrom's source, or the connected socket's peer).
	Answer netip.Addr     `json:"answer,omitzero"`
	From   netip.AddrPort `json:"from,omitzero"`
	// Replies of op dial-many, one per connection.
	Replies []DialResult `json:"replies,omitempty"`
	// Echoed is how many bytes op bulk-tcp read back, all as sent.
	Echoed int64 `json:"echoed,omitempty"`
	// Op churn-tcp: connections that failed once connected, those that
	// could not connect, and the first failure.
	Failures        int64  `json:"failures,omitempty"`
	ConnectFailures int64  `json:"connectFailures,omitempty"`
	FirstError      string `json:"firstError,omitempty"`
}

// DialResult is one connection of op dial-many.
type DialResult struct {
	Err   string         `json:"err,omitempty"`
	Local netip.AddrPort `json:"local,omitzero"`
	Reply *standin.Reply `json:"reply,omitempty"`
}

type handler interface {
	handle(line []byte) any
}

// serveJSON answers one JSON line per request line on stdin.
func serveJSON(h handler) error {
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(map[string]bool{"Ready": true}); err != nil {
		return err
	}
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		if err := enc.Encode(h.handle(sc.Bytes())); err != nil {
			return err
		}
	}
	return sc.Err()
}

type app struct {
	ns      *sockutil.Netns
	streams map[string]*stream      // kept connections by name
	held    map[string]net.Listener // listeners of op listen-hold by name
}

// stream is a connection op stream-open keeps for stream-echo.
type stream struct {
	*bufio.ReadWriter
	c net.Conn
}

func newApp() *app {
	ns, err := sockutil.EnterNetns(nil)
	if err != nil {
		panic(err)
	}
	return &app{ns: ns, streams: map[string]*stream{}, held: map[string]net.Listener{}}
}

func (a *app) handle(line []byte) any {
	var req AppRequest
	if err := json.Unmarshal(line, &req); err != nil {
		return AppResponse{Err: err.Error()}
	}
	resp, err := a.do(req)
	if err != nil {
		// What the op found before it failed (a dial's client address)
		// goes back with the error.
		resp.OK, resp.Err = false, err.Error()
		return resp
	}
	resp.OK = true
	return resp
}

func (a *app) do(req AppRequest) (AppResponse, error) {
	opts := sockutil.Opts{Mark: req.Mark, Bind: req.Bind, Transparent: req.Transparent, FreeBind: req.Transparent}
	switch req.Op {
	case "listen-tcp":
		l, err := a.ns.Listen(req.Addr, sockutil.Opts{ReusePort: true})
		if err != nil {
			return AppResponse{}, err
		}
		go serveTCP(l, req.Name)
		return AppResponse{Local: sockutil.AddrPort(l.Addr())}, nil
	case "listen-udp":
		c, err := a.ns.ListenUDP(req.Addr, sockutil.Opts{ReusePort: true})
		if err != nil {
			return AppResponse{}, err
		}
		go serveUDP(c, req.Name)
		return AppResponse{Local: sockutil.AddrPort(c.LocalAddr())}, nil
	case "ping":
		return AppResponse{}, ping(req.Addr.Addr())
	case "dns-server":
		return AppResponse{}, a.dnsServer(req.Addr, req.Answer)
	case "dns":
		return a.dnsQuery(req)
	case "dial-many":
		return a.dialMany(req), nil
	case "listen-echo":
		l, err := a.ns.Listen(req.Addr, sockutil.Opts{ReusePort: true, MPTCP: req.MPTCP})
		if err != nil {
			return AppResponse{}, err
		}
		go serveEcho(l, req.ReadWrite)
		return AppResponse{Local: sockutil.AddrPort(l.Addr())}, nil
	case "listen-hold":
		// Connections complete in the backlog; accept-orig-dst takes them
		// one at a time, as a ztunnel that is late to accept would.
		l, err := a.ns.Listen(req.Addr, sockutil.Opts{})
		if err != nil {
			return AppResponse{}, err
		}
		a.held[req.Name] = l
		return AppResponse{Local: sockutil.AddrPort(l.Addr())}, nil
	case "accept-orig-dst":
		l := a.held[req.Name]
		if l == nil {
			return AppResponse{}, fmt.Errorf("no held listener %q", req.Name)
		}
		c, err := l.Accept()
		if err != nil {
			return AppResponse{}, err
		}
		defer c.Close()
		dst, _, err := sockutil.OriginalDst(c)
		return AppResponse{Remote: sockutil.AddrPort(c.RemoteAddr()), OrigDst: dst}, err
	case "stream-open":
		timeout := 5 * time.Second
		if req.Timeout > 0 {
			timeout = req.Timeout
		}
		c, err := a.ns.Dial(req.Addr, opts, timeout)
		if err != nil {
			return AppResponse{}, err
		}
		a.streams[req.Name] = &stream{bufio.NewReadWriter(bufio.NewReader(c), bufio.NewWriter(c)), c}
		return AppResponse{Local: sockutil.AddrPort(c.LocalAddr())}, nil
	case "stream-close":
		rw := a.streams[req.Name]
		if rw == nil {
			return AppResponse{}, fmt.Errorf("no stream %q", req.Name)
		}
		delete(a.streams, req.Name)
		return AppResponse{}, rw.c.Close()
	case "stream-echo":
		rw := a.streams[req.Name]
		if rw == nil {
			return AppResponse{}, fmt.Errorf("no stream %q", req.Name)
		}
		// A broken stream answers with a RST, or not at all: give up then.
		_ = rw.c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := rw.WriteString(req.DNSName + "\n"); err != nil {
			return AppResponse{}, err
		}
		if err := rw.Flush(); err != nil {
			return AppResponse{}, err
		}
		line, err := rw.ReadString('\n')
		if err != nil {
			return AppResponse{}, fmt.Errorf("stream %q broke: %w", req.Name, err)
		}
		if strings.TrimSpace(line) != req.DNSName {
			return AppResponse{}, fmt.Errorf("stream %q echoed %q, sent %q", req.Name, line, req.DNSName)
		}
		return AppResponse{}, nil
	case "bulk-tcp":
		return bulk(a.ns, req)
	case "churn-tcp":
		return churn(a.ns, req), nil
	case "dial-tcp", "dial-udp":
		dst := req.Addr
		if req.Mapped {
			opts.Family = 10 // AF_INET6
			dst = netip.AddrPortFrom(netip.AddrFrom16(dst.Addr().As16()), dst.Port())
			if req.Bind.IsValid() {
				opts.Bind = netip.AddrPortFrom(netip.AddrFrom16(req.Bind.Addr().As16()), req.Bind.Port())
			}
		}
		var c net.Conn
		var err error
		start := time.Now()
		if req.Op == "dial-tcp" {
			timeout := 3 * time.Second
			if req.Timeout > 0 {
				timeout = req.Timeout
			}
			c, err = a.ns.Dial(dst, opts, timeout)
		} else {
			c, err = a.ns.DialUDP(dst, opts)
		}
		if de := (*sockutil.DialError)(nil); errors.As(err, &de) {
			return AppResponse{Local: de.Local}, err
		}
		if err != nil {
			return AppResponse{}, err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write([]byte("hello\n")); err != nil {
			return AppResponse{}, err
		}
		reply, err := readReply(c)
		if err != nil {
			return AppResponse{Local: sockutil.AddrPort(c.LocalAddr())}, err
		}
		if req.WaitEOF {
			if _, err := io.Copy(io.Discard, c); err != nil {
				return AppResponse{}, fmt.Errorf("waiting for the server to close: %w", err)
			}
		}
		resp := AppResponse{Reply: reply, Local: sockutil.AddrPort(c.LocalAddr()), Start: start}
		if tc, ok := c.(*net.TCPConn); ok {
			if sc, err := tc.SyscallConn(); err == nil {
				_ = sc.Control(func(fd uintptr) {
					if sa, err := unix.Getpeername(int(fd)); err == nil {
						resp.Remote = sockutil.SockaddrAddrPort(sa)
					}
				})
			}
		}
		return resp, nil
	}
	return AppResponse{}, fmt.Errorf("unknown op %q", req.Op)
}

func readReply(c net.Conn) (*standin.Reply, error) {
	buf := make([]byte, 4096)
	var got []byte
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if i := strings.IndexByte(string(got), '\n'); i >= 0 {
			var r standin.Reply
			if err := json.Unmarshal(got[:i], &r); err != nil {
				return nil, fmt.Errorf("bad reply %q: %w", got[:i], err)
			}
			return &r, nil
		}
		if err != nil {
			if len(got) == 0 {
				return nil, fmt.Errorf("no reply: %w", err)
			}
			return nil, fmt.Errorf("short reply %q: %w", got, err)
		}
	}
}

// bulk sends req.Bytes of a seeded pseudo-random stream to an echo server
// in writes of 1 byte to 256 KiB, half-closes, and checks that exactly the
// stream comes back before EOF.
func bulk(ns *sockutil.Netns, req AppRequest) (AppResponse, error) {
	c, err := ns.Dial(req.Addr, sockutil.Opts{Mark: req.Mark, Bind: req.Bind, MPTCP: req.MPTCP}, 5*time.Second)
	if err != nil {
		return AppResponse{}, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(60 * time.Second))
	stream := func() *rand.ChaCha8 {
		return rand.NewChaCha8([32]byte{byte(req.Bytes), byte(req.Bytes >> 8), byte(req.Bytes >> 16)})
	}
	werr := make(chan error, 1)
	go func() {
		src, sizes := stream(), rand.New(rand.NewPCG(1, uint64(req.Bytes)))
		buf := make([]byte, 256<<10)
		for left := req.Bytes; left > 0; {
			n := min(left, 1+sizes.IntN(len(buf)))
			_, _ = src.Read(buf[:n])
			if _, err := c.Write(buf[:n]); err != nil {
				werr <- fmt.Errorf("write: %w", err)
				return
			}
			left -= n
		}
		werr <- c.(*net.TCPConn).CloseWrite()
	}()
	want, got := stream(), make([]byte, 64<<10)
	exp := make([]byte, len(got))
	var echoed int64
	for {
		n, err := c.Read(got)
		if n > 0 {
			_, _ = want.Read(exp[:n])
			if !bytes.Equal(got[:n], exp[:n]) {
				return AppResponse{}, fmt.Errorf("echo differs from what was sent after %d bytes", echoed)
			}
			echoed += int64(n)
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return AppResponse{}, fmt.Errorf("read after %d bytes: %w", echoed, err)
		}
	}
	if err := <-werr; err != nil {
		return AppResponse{}, err
	}
	return AppResponse{Local: sockutil.AddrPort(c.LocalAddr()), Echoed: echoed}, nil
}

// churn runs req.Count short connections to an echo server, eight at a
// time: each sends 64 bytes, half-closes, reads them back to EOF and
// closes, so the server side closes second, as ztunnel's relay does. It
// counts connections that failed once connected (Failures) apart from
// those that could not connect.
func churn(ns *sockutil.Netns, req AppRequest) AppResponse {
	var failed, unconnected atomic.Int64
	var first atomic.Value
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			msg := make([]byte, 64)
			for next.Add(1) <= int64(req.Count) {
				connected, err := churnOne(ns, req.Addr, msg)
				if err == nil {
					continue
				}
				if connected {
					failed.Add(1)
				} else {
					unconnected.Add(1)
				}
				first.CompareAndSwap(nil, err.Error())
			}
		})
	}
	wg.Wait()
	res := AppResponse{Failures: failed.Load(), ConnectFailures: unconnected.Load()}
	res.FirstError, _ = first.Load().(string)
	return res
}

func churnOne(ns *sockutil.Netns, dst netip.AddrPort, msg []byte) (connected bool, err error) {
	c, err := ns.Dial(dst, sockutil.Opts{}, 5*time.Second)
	if err != nil {
		return false, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(msg); err != nil {
		return true, fmt.Errorf("write: %w", err)
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return true, err
	}
	got, err := io.ReadAll(c)
	if err != nil {
		return true, fmt.Errorf("read the echo (%d bytes so far): %w", len(got), err)
	}
	if len(got) != len(msg) {
		return true, fmt.Errorf("echoed %d bytes, sent %d", len(got), len(msg))
	}
	return true, nil
}

// dialMany holds Count connections open at once, then has each say hello.
func (a *app) dialMany(req AppRequest) AppResponse {
	results := make([]DialResult, req.Count)
	conns := make([]net.Conn, req.Count)
	var wg sync.WaitGroup
	for i := range req.Count {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Generous: hundreds of connections at once on a loaded 2-core
			// machine; this measures what happened, not how fast.
			c, err := a.ns.Dial(req.Addr, sockutil.Opts{Bind: req.Bind}, 20*time.Second)
			if err != nil {
				results[i].Err = err.Error()
				return
			}
			conns[i] = c
			results[i].Local = sockutil.AddrPort(c.LocalAddr())
		}()
	}
	wg.Wait()
	for i, c := range conns {
		if c == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(20 * time.Second))
			if _, err := c.Write([]byte("hello\n")); err != nil {
				results[i].Err = err.Error()
				return
			}
			r, err := readReply(c)
			if err != nil {
				results[i].Err = err.Error()
				return
			}
			results[i].Reply = r
		}()
	}
	wg.Wait()
	return AppResponse{Replies: results}
}

// dnsServer answers every A query with answer, over UDP and TCP.
func (a *app) dnsServer(addr netip.AddrPort, answer netip.Addr) error {
	uc, err := a.ns.ListenUDP(addr, sockutil.Opts{ReusePort: true})
	if err != nil {
		return err
	}
	l, err := a.ns.Listen(addr, sockutil.Opts{ReusePort: true})
	if err != nil {
		uc.Close()
		return err
	}
	respond := func(query []byte) []byte {
		var msg dnsmessage.Message
		if msg.Unpack(query) != nil || len(msg.Questions) != 1 {
			return nil
		}
		reply, _ := standin.BuildAnswer(msg.Header.ID, msg.Questions[0], answer)
		return reply
	}
	go func() {
		buf := make([]byte, 4096)
		for {
			n, from, err := uc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			if reply := respond(buf[:n]); reply != nil {
				_, _ = uc.WriteToUDPAddrPort(reply, from)
			}
		}
	}()
	go standin.ServeDNSTCP(l, func(_ netip.AddrPort, q []byte) []byte { return respond(q) })
	return nil
}

// dnsQuery asks req.Addr for req.DNSName the way resolvers do: UDP
// sendto/recvfrom (or a connected UDP socket), or TCP.
func (a *app) dnsQuery(req AppRequest) (AppResponse, error) {
	query, err := standin.BuildQuery(uint16(time.Now().UnixNano()), req.DNSName)
	if err != nil {
		return AppResponse{}, err
	}
	var reply []byte
	var from netip.AddrPort
	switch {
	case req.Proto == "tcp":
		c, err := a.ns.Dial(req.Addr, sockutil.Opts{}, 3*time.Second)
		if err != nil {
			return AppResponse{}, err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if err := standin.WriteTCPMessage(c, query); err != nil {
			return AppResponse{}, err
		}
		if reply, err = standin.ReadTCPMessage(c); err != nil {
			return AppResponse{}, err
		}
		from = sockutil.AddrPort(c.RemoteAddr()) // getpeername()
	case req.Connected:
		c, err := a.ns.DialUDP(req.Addr, sockutil.Opts{})
		if err != nil {
			return AppResponse{}, err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Write(query); err != nil {
			return AppResponse{}, err
		}
		buf := make([]byte, 4096)
		n, err := c.Read(buf)
		if err != nil {
			return AppResponse{}, err
		}
		reply, from = buf[:n], sockutil.AddrPort(c.RemoteAddr())
	default:
		wildcard := netip.IPv4Unspecified()
		if req.Addr.Addr().Is6() {
			wildcard = netip.IPv6Unspecified()
		}
		c, err := a.ns.ListenUDP(netip.AddrPortFrom(wildcard, 0), sockutil.Opts{})
		if err != nil {
			return AppResponse{}, err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.WriteToUDPAddrPort(query, req.Addr); err != nil {
			return AppResponse{}, err
		}
		buf := make([]byte, 4096)
		n, src, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return AppResponse{}, err
		}
		reply, from = buf[:n], netip.AddrPortFrom(src.Addr().Unmap(), src.Port())
	}
	answer, err := standin.FirstAnswer(reply)
	if err != nil {
		return AppResponse{}, err
	}
	return AppResponse{Answer: answer, From: from}, nil
}

// ping sends one ICMP echo request and waits for the reply.
func ping(dst netip.Addr) error {
	network, typ, proto := "ip4:icmp", icmp.Type(ipv4.ICMPTypeEcho), 1
	if dst.Is6() {
		network, typ, proto = "ip6:ipv6-icmp", ipv6.ICMPTypeEchoRequest, 58
	}
	c, err := icmp.ListenPacket(network, "")
	if err != nil {
		return err
	}
	defer c.Close()
	msg := icmp.Message{Type: typ, Body: &icmp.Echo{ID: os.Getpid() & 0xffff, Seq: 1, Data: []byte("ambient")}}
	b, err := msg.Marshal(nil)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(b, &net.IPAddr{IP: net.IP(dst.AsSlice())}); err != nil {
		return err
	}
	_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
	buf := make([]byte, 1500)
	for {
		n, _, err := c.ReadFrom(buf)
		if err != nil {
			return fmt.Errorf("no echo reply from %s: %w", dst, err)
		}
		m, err := icmp.ParseMessage(proto, buf[:n])
		if err == nil && (m.Type == ipv4.ICMPTypeEchoReply || m.Type == ipv6.ICMPTypeEchoReply) {
			return nil
		}
	}
}

// serveEcho echoes lines back on each connection until it closes.
func serveEcho(l net.Listener, readWrite bool) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			if readWrite {
				// Hidden behind plain interfaces, io.Copy reads and
				// writes instead of splicing.
				_, _ = io.Copy(struct{ io.Writer }{c}, struct{ io.Reader }{c})
				return
			}
			_, _ = io.Copy(c, c) // splice(2) from the socket to itself
		}()
	}
}

// serveTCP answers each connection with who the server saw, then closes.
func serveTCP(l net.Listener, name string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(30 * time.Second))
			r := bufio.NewReader(c)
			if _, err := r.ReadString('\n'); err != nil {
				return
			}
			_ = json.NewEncoder(c).Encode(standin.Reply{Server: name, Local: sockutil.AddrPort(c.LocalAddr()), Peer: sockutil.AddrPort(c.RemoteAddr())})
		}()
	}
}

func serveUDP(c *net.UDPConn, name string) {
	buf := make([]byte, 2048)
	for {
		_, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		b, _ := json.Marshal(standin.Reply{Server: name, Local: sockutil.AddrPort(c.LocalAddr()), Peer: netip.AddrPortFrom(from.Addr().Unmap(), from.Port())})
		_, _ = c.WriteToUDPAddrPort(append(b, '\n'), from)
	}
}

// ZDSSocketEnv names the ZDS socket the ztunnel helper connects to.
const ZDSSocketEnv = "AMBIENT_EBPF_ZDS_SOCKET"

// DNSTableEnv adds name=address entries (comma-separated) to the ztunnel
// helper's DNS table.
const DNSTableEnv = "AMBIENT_EBPF_DNS_TABLE"

// ZDSAckDelayEnv holds each of the ztunnel helper's ZDS answers for a
// duration (standin.Config.AckDelay); ZDSNackAddsEnv makes it refuse its
// first adds (standin.Config.NackAdds).
const (
	ZDSAckDelayEnv = "AMBIENT_EBPF_ZDS_ACK_DELAY"
	ZDSNackAddsEnv = "AMBIENT_EBPF_ZDS_NACK_ADDS"
)

// runZtunnel is the stand-in taking pods over ZDS, until stdin closes.
func runZtunnel() error {
	cfg := standin.Config{DNS: standin.DNS{
		Table:    map[string]netip.Addr{"*." + KnownDNSSuffix: KnownDNSAnswer},
		Upstream: netip.AddrPortFrom(OutsideV4, 53),
	}}
	for _, entry := range strings.Split(os.Getenv(DNSTableEnv), ",") {
		if name, addr, ok := strings.Cut(entry, "="); ok {
			a, err := netip.ParseAddr(addr)
			if err != nil {
				return fmt.Errorf("%s: %w", DNSTableEnv, err)
			}
			cfg.DNS.Table[name] = a
		}
	}
	if v := os.Getenv(ZDSAckDelayEnv); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return fmt.Errorf("%s: %w", ZDSAckDelayEnv, err)
		}
		cfg.AckDelay = d
	}
	if v := os.Getenv(ZDSNackAddsEnv); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("%s: %w", ZDSNackAddsEnv, err)
		}
		cfg.NackAdds = n
	}
	for env, w := range map[string]*io.Writer{RecordsEnv: &cfg.Records, TranscriptEnv: &cfg.Transcript} {
		if path := os.Getenv(env); path != "" {
			f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
			if err != nil {
				return err
			}
			defer f.Close()
			*w = f
		}
	}
	proxy := standin.New(cfg)
	defer proxy.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- proxy.ServeZDS(ctx, os.Getenv(ZDSSocketEnv)) }()
	err := serveJSON(ztunnelOps{proxy})
	cancel()
	if zerr := <-errc; zerr != nil && !errors.Is(zerr, context.Canceled) {
		return errors.Join(err, zerr)
	}
	return err
}

// noOps answers every request with an error: the ztunnel helper is driven
// over ZDS; stdin only holds its lifetime.
// ztunnelOps are the ztunnel helper's commands: op zds-drop closes its ZDS
// connection (it reconnects).
type ztunnelOps struct{ p *standin.Proxy }

func (z ztunnelOps) handle(line []byte) any {
	var req AppRequest
	if err := json.Unmarshal(line, &req); err != nil {
		return AppResponse{Err: err.Error()}
	}
	switch req.Op {
	case "zds-drop":
		if !z.p.DropZDS() {
			return AppResponse{Err: "no ZDS connection to drop"}
		}
		return AppResponse{OK: true}
	}
	return AppResponse{Err: fmt.Sprintf("the ztunnel helper has no op %q", req.Op)}
}
