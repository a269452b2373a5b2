// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"net/netip"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
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
	f, err := os.Open(p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ns, err := sockutil.EnterNetns(f)
	if err != nil {
		t.Fatalf("enter %s: %v", p.NS, err)
	}
	defer ns.Close()
	l, err := ns.Listen(netip.MustParseAddrPort("0.0.0.0:15001"), sockutil.Opts{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	client := netip.AddrPortFrom(a, simnode.FixedClientPort)
	seen := map[netip.AddrPort]netip.AddrPort{} // destination -> the listener's peer
	for _, dst := range []netip.AddrPort{netip.AddrPortFrom(a, 8080), netip.AddrPortFrom(b, 8080)} {
		// Both bound to the client port: connections to two
		// destinations may share it.
		c, err := ns.Dial(dst, sockutil.Opts{Bind: client, ReusePort: true}, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		s, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		seen[dst] = sockutil.AddrPort(s.RemoteAddr())
	}
	for dst, peer := range seen {
		got, remapped := remappedPeer(p.NetnsPath(), client, dst)
		if want := peer.Port() != client.Port(); remapped != want || (remapped && got != peer) {
			t.Errorf("to %s: remappedPeer = %s, %v; the listener saw %s", dst, got, remapped, peer)
		}
	}
	if seen[netip.AddrPortFrom(b, 8080)].Port() == client.Port() {
		t.Errorf("the second connection kept its port %d: no clash to test", client.Port())
	}
}
