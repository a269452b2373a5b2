// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"net"
	"net/netip"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The sampler's remappedPeer, on what it stands for: two connections from
// one client port to two destinations that a REDIRECT sends to one port
// clash after it, and conntrack gives the second a new source port, which
// the listener sees and remappedPeer finds.
func TestRemappedPeerFindsAPortREDIRECTRemapped(t *testing.T) {
	n := simnode.New(t)
	p := n.AddBarePod("remap", "default", "8aaa37a3-0000-4000-8000-0000000000f0")
	a, b := netip.MustParseAddr("198.18.0.1"), netip.MustParseAddr("198.18.0.2")
	for _, addr := range []netip.Addr{a, b} {
		n.IP(p.NS, "addr", "add", addr.String()+"/32", "dev", "lo")
	}
	if out, err := exec.Command("nsenter", "--net="+p.NetnsPath(), "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "--dport", "8080", "-j", "REDIRECT", "--to-ports", "15001").CombinedOutput(); err != nil {
		t.Fatalf("iptables in %s: %v: %s", p.NS, err, out)
	}
	client := netip.AddrPortFrom(a, 40000)
	seen := map[netip.AddrPort]netip.AddrPort{} // destination -> the listener's peer
	err := simnode.InNetns(p.NS, func() error {
		l, err := net.Listen("tcp4", "0.0.0.0:15001")
		if err != nil {
			return err
		}
		defer l.Close()
		reuse := func(_, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1) }); err != nil {
				return err
			}
			return serr
		}
		d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(client), Control: reuse}
		for _, dst := range []netip.AddrPort{netip.AddrPortFrom(a, 8080), netip.AddrPortFrom(b, 8080)} {
			c, err := d.Dial("tcp4", dst.String())
			if err != nil {
				return err
			}
			defer c.Close()
			s, err := l.Accept()
			if err != nil {
				return err
			}
			defer s.Close()
			seen[dst] = s.RemoteAddr().(*net.TCPAddr).AddrPort()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("connections in %s: %v", p.NS, err)
	}
	for dst, peer := range seen {
		got, remapped := remappedPeer(p.NetnsPath(), client, dst)
		if want := peer.Port() != client.Port(); remapped != want || (remapped && netip.AddrPortFrom(got.Addr().Unmap(), got.Port()) != netip.AddrPortFrom(peer.Addr().Unmap(), peer.Port())) {
			t.Errorf("to %s: remappedPeer = %s, %v; the listener saw %s", dst, got, remapped, peer)
		}
	}
	if seen[netip.AddrPortFrom(b, 8080)].Port() == client.Port() {
		t.Errorf("the second connection kept its port %d: no clash to test", client.Port())
	}
}
