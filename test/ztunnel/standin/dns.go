// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standin

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// DNSPort is ztunnel's in-pod DNS proxy port.
const DNSPort = 15053

// DNS answers A and AAAA queries from a table and forwards the rest
// upstream, as ztunnel's DNS proxy does.
type DNS struct {
	// Table maps names (with or without the final dot; a leading "*."
	// matches any subdomain) to the address answered.
	Table map[string]netip.Addr
	// Upstream receives the queries the table cannot answer.
	Upstream netip.AddrPort
}

func (d *DNS) lookup(name string) (netip.Addr, bool) {
	name = strings.TrimSuffix(name, ".")
	for pattern, addr := range d.Table {
		pattern = strings.TrimSuffix(pattern, ".")
		if pattern == name {
			return addr, true
		}
		if suffix, ok := strings.CutPrefix(pattern, "*."); ok && strings.HasSuffix(name, "."+suffix) {
			return addr, true
		}
	}
	return netip.Addr{}, false
}

// Answer builds the reply to query: from the table when it knows the name.
// ok is false when the query must go upstream.
func (d *DNS) Answer(query []byte) (reply []byte, name string, ok bool, err error) {
	var msg dnsmessage.Message
	if err := msg.Unpack(query); err != nil {
		return nil, "", false, fmt.Errorf("bad query: %w", err)
	}
	if len(msg.Questions) != 1 {
		return nil, "", false, errors.New("query without exactly one question")
	}
	q := msg.Questions[0]
	name = q.Name.String()
	addr, found := d.lookup(name)
	if !found {
		return nil, name, false, nil
	}
	reply, err = BuildAnswer(msg.Header.ID, q, addr)
	return reply, name, true, err
}

// BuildAnswer makes a response with one A or AAAA record.
func BuildAnswer(id uint16, q dnsmessage.Question, addr netip.Addr) ([]byte, error) {
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: id, Response: true, Authoritative: true, RecursionAvailable: true})
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	if err := b.Question(q); err != nil {
		return nil, err
	}
	if err := b.StartAnswers(); err != nil {
		return nil, err
	}
	hdr := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 30}
	switch {
	case q.Type == dnsmessage.TypeA && addr.Is4():
		if err := b.AResource(hdr, dnsmessage.AResource{A: addr.As4()}); err != nil {
			return nil, err
		}
	case q.Type == dnsmessage.TypeAAAA && addr.Is6():
		if err := b.AAAAResource(hdr, dnsmessage.AAAAResource{AAAA: addr.As16()}); err != nil {
			return nil, err
		}
	}
	return b.Finish()
}

// BuildQuery makes an A query for name.
func BuildQuery(id uint16, name string) ([]byte, error) {
	if !strings.HasSuffix(name, ".") {
		name += "."
	}
	n, err := dnsmessage.NewName(name)
	if err != nil {
		return nil, err
	}
	msg := dnsmessage.Message{Header: dnsmessage.Header{ID: id, RecursionDesired: true},
		Questions: []dnsmessage.Question{{Name: n, Type: dnsmessage.TypeA, Class: dnsmessage.ClassINET}}}
	return msg.Pack()
}

// FirstAnswer returns the first A/AAAA address of a response.
func FirstAnswer(resp []byte) (netip.Addr, error) {
	var msg dnsmessage.Message
	if err := msg.Unpack(resp); err != nil {
		return netip.Addr{}, err
	}
	for _, a := range msg.Answers {
		switch r := a.Body.(type) {
		case *dnsmessage.AResource:
			return netip.AddrFrom4(r.A), nil
		case *dnsmessage.AAAAResource:
			return netip.AddrFrom16(r.AAAA), nil
		}
	}
	return netip.Addr{}, errors.New("no address in the answer")
}

// ReadTCPMessage reads one length-prefixed DNS message.
func ReadTCPMessage(r io.Reader) ([]byte, error) {
	var l [2]byte
	if _, err := io.ReadFull(r, l[:]); err != nil {
		return nil, err
	}
	msg := make([]byte, binary.BigEndian.Uint16(l[:]))
	_, err := io.ReadFull(r, msg)
	return msg, err
}

// WriteTCPMessage writes one length-prefixed DNS message.
func WriteTCPMessage(w io.Writer, msg []byte) error {
	b := binary.BigEndian.AppendUint16(nil, uint16(len(msg)))
	_, err := w.Write(append(b, msg...))
	return err
}

// serveDNS opens the pod's DNS proxy sockets (127.0.0.1 and ::1, UDP and
// TCP, marked and SO_REUSEPORT like every ztunnel socket).
func (p *Proxy) serveDNS(pd *pod) error {
	opts := sockutil.Opts{Mark: Mark, ReusePort: true}
	for _, ip := range []netip.Addr{netip.MustParseAddr("127.0.0.1"), netip.IPv6Loopback()} {
		addr := netip.AddrPortFrom(ip, DNSPort)
		uc, err := pd.ns.ListenUDP(addr, opts)
		if err != nil {
			return err
		}
		l, err := pd.ns.Listen(addr, opts)
		if err != nil {
			uc.Close()
			return err
		}
		pd.closers = append(pd.closers, uc, l)
		pd.wg.Add(2)
		go func() { defer pd.wg.Done(); p.serveDNSUDP(pd, uc) }()
		go func() { defer pd.wg.Done(); p.serveDNSTCP(pd, l) }()
	}
	return nil
}

// resolve answers a query from the table or upstream (with a marked
// socket, so ztunnel's own query is never captured again).
func (p *Proxy) resolve(pd *pod, peer netip.AddrPort, query []byte) ([]byte, error) {
	rec := Record{Time: time.Now(), Pod: pd.uid, Listener: DNSPort, Peer: peer}
	reply, name, ok, err := p.cfg.DNS.Answer(query)
	rec.DNSName = name
	if err == nil && !ok {
		rec.DNSUpstream = true
		reply, err = p.forward(pd, query)
	}
	if err != nil {
		rec.Error = err.Error()
	}
	p.record(rec)
	return reply, err
}

func (p *Proxy) forward(pd *pod, query []byte) ([]byte, error) {
	up := p.cfg.DNS.Upstream
	if !up.IsValid() {
		return nil, errors.New("no upstream DNS server")
	}
	c, err := pd.ns.DialUDP(up, sockutil.Opts{Mark: Mark})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write(query); err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		return nil, fmt.Errorf("upstream %s: %w", up, err)
	}
	return buf[:n], nil
}

func (p *Proxy) serveDNSUDP(pd *pod, c *net.UDPConn) {
	buf := make([]byte, 4096)
	for {
		n, from, err := c.ReadFromUDPAddrPort(buf)
		if err != nil {
			return
		}
		query := append([]byte(nil), buf[:n]...)
		go func() {
			reply, err := p.resolve(pd, netip.AddrPortFrom(from.Addr().Unmap(), from.Port()), query)
			if err == nil {
				_, _ = c.WriteToUDPAddrPort(reply, from)
			}
		}()
	}
}

func (p *Proxy) serveDNSTCP(pd *pod, l net.Listener) {
	ServeDNSTCP(l, func(peer netip.AddrPort, query []byte) []byte {
		reply, err := p.resolve(pd, peer, query)
		if err != nil {
			return nil
		}
		return reply
	})
}

// ServeDNSTCP answers length-prefixed DNS queries on each connection of l
// (one query per connection) until l closes; answer returns nil to send
// nothing.
func ServeDNSTCP(l net.Listener, answer func(peer netip.AddrPort, query []byte) []byte) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(5 * time.Second))
			query, err := ReadTCPMessage(c)
			if err != nil {
				return
			}
			if reply := answer(sockutil.AddrPort(c.RemoteAddr()), query); reply != nil {
				_ = WriteTCPMessage(c, reply)
			}
		}()
	}
}
