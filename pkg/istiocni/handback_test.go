// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The hand-back's hazard: an inbound connection established while
// istio-cni's rules were absent (under eBPF: no conntrack in the pod) is
// picked up mid-stream by conntrack once they are re-applied
// (nf_conntrack_tcp_loose=1, the default) as a NEW flow, and istio-cni's
// nat PREROUTING REDIRECT sends its next segment to ztunnel's :15006
// listener, which resets it. Either of two things keeps it: the pod's
// nf_conntrack_tcp_loose=0 (mid-stream segments are INVALID, never NATed,
// and reach their socket), or an ESTABLISHED conntrack entry created for
// the connection before the rules come (it is looked up, not NATed).
func TestHandBackMidStream(t *testing.T) {
	for _, b := range []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat} {
		for _, mode := range []string{"loose", "strict", "precreated"} {
			t.Run(string(b)+"/"+mode, func(t *testing.T) { handBackMidStream(t, b, mode) })
		}
	}
}

func handBackMidStream(t *testing.T, b istiocni.Backend, mode string) {
	n := simnode.New(t)
	p := n.AddPod("handback")
	zt := n.StartZtunnel()
	zt.Add(p) // ztunnel listens in the pod, as in ambient mode either way
	out := n.StartOutsideApp()
	app := n.StartApp(p)
	peers := map[string]netip.AddrPort{}
	for fam, a := range map[string]netip.Addr{"ipv4": p.V4, "ipv6": p.V6} {
		pod := netip.AddrPortFrom(a, 7008)
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: pod}); err != nil {
			t.Fatal(err)
		}
		resp, err := out.Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: pod})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := out.Do(simnode.AppRequest{Op: "stream-echo", Name: fam, DNSName: "before"}); err != nil {
			t.Fatal(err)
		}
		if r, ok := zt.RecordFor(resp.Local); ok {
			t.Fatalf("%s: redirected before istio-cni's rules: %+v", fam, r)
		}
		peers[fam] = resp.Local
		if mode == "precreated" {
			establish(t, p.NetnsPath(), resp.Local, pod)
		}
	}
	if mode == "strict" {
		n.Sysctl(p.NS, "net/netfilter/nf_conntrack_tcp_loose", "0")
	}
	applyInpod(t, p.NetnsPath(), b, podopts.Options{DNSCapture: true})
	for fam, peer := range peers {
		_, err := out.Do(simnode.AppRequest{Op: "stream-echo", Name: fam, DNSName: "after"})
		r, redirected := zt.RecordFor(peer)
		t.Logf("%s: after istio-cni's rules: echo error %v; picked up by ztunnel: %v %+v", fam, err, redirected, r)
		switch {
		case mode == "loose" && err == nil:
			t.Errorf("%s: the mid-stream connection survived istio-cni's rules with tcp_loose=1", fam)
		case mode != "loose" && err != nil:
			t.Errorf("%s: the mid-stream connection broke with %s: %v", fam, mode, err)
		}
	}
	// istio-cni's rules still redirect a new connection.
	for fam, a := range map[string]netip.Addr{"ipv4": p.V4, "ipv6": p.V6} {
		resp, err := out.Do(simnode.AppRequest{Op: "stream-open", Name: fam + "-new", Addr: netip.AddrPortFrom(a, 7008)})
		if err != nil {
			t.Fatal(err)
		}
		if r, ok := awaitRecord(zt, resp.Local); !ok || r.Listener != 15006 {
			t.Errorf("%s: a new inbound connection was not redirected to 15006: %+v", fam, r)
		}
		if _, err := out.Do(simnode.AppRequest{Op: "stream-echo", Name: fam + "-new", DNSName: "new"}); err != nil {
			t.Errorf("%s: the new, redirected connection: %v", fam, err)
		}
	}
}

// establish creates an ESTABLISHED, un-NATed conntrack entry in the netns
// for the TCP connection from client to server.
func establish(t *testing.T, path string, client, server netip.AddrPort) {
	ns, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	c, err := conntrack.Dial(&netlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// No status bits: this kernel (6.18) refuses SEEN_REPLY and ASSURED on
	// create (EBUSY); the next segments set them.
	f := conntrack.NewFlow(unix.IPPROTO_TCP, 0,
		client.Addr(), server.Addr(), client.Port(), server.Port(), 3600, 0)
	f.ProtoInfo.TCP = &conntrack.ProtoInfoTCP{State: 3} // TCP_CONNTRACK_ESTABLISHED
	if err := c.Create(f); err != nil {
		t.Fatal(fmt.Errorf("create the conntrack entry of %s -> %s: %w", client, server, err))
	}
}

// A conntrack entry left ESTABLISHED with no connection behind it (the
// connection ended under eBPF after a takeover's drain went, with
// conntrack off in the pod, so its end was never seen; such an entry lives
// five days) must not keep a later connection with its tuple from
// istio-cni's REDIRECT once the rules are back: conntrack ignores a SYN in
// ESTABLISHED, and the SYN would keep the entry's null NAT binding and
// reach the app past ztunnel. ApplyPod deletes such entries first.
func TestHandBackRedirectsAConnectionWithAStaleTuple(t *testing.T) {
	for _, b := range []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat} {
		t.Run(string(b), func(t *testing.T) {
			n := simnode.New(t)
			p := n.AddPod("stale")
			zt := n.StartZtunnel()
			zt.Add(p)
			out := n.StartOutsideApp()
			app := n.StartApp(p)
			clients := map[string]netip.AddrPort{
				"ipv4": netip.AddrPortFrom(simnode.OutsideV4, simnode.FixedClientPort+7),
				"ipv6": netip.AddrPortFrom(simnode.OutsideV6, simnode.FixedClientPort+7),
			}
			servers := map[string]netip.AddrPort{"ipv4": netip.AddrPortFrom(p.V4, 7009), "ipv6": netip.AddrPortFrom(p.V6, 7009)}
			if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 7009)}); err != nil {
				t.Fatal(err)
			}
			for fam := range clients {
				establish(t, p.NetnsPath(), clients[fam], servers[fam])
			}
			// The hand-back writes the rules; istio-cni's own would
			// leave the entries, and the connections unredirected.
			if err := istiocni.New().ApplyPod(context.Background(), p.NetnsPath(), b, podopts.Options{}); err != nil {
				t.Fatal(err)
			}
			for fam := range clients {
				resp, err := out.Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: servers[fam], Bind: clients[fam]})
				if err != nil {
					t.Fatalf("%s: connect from %s: %v", fam, clients[fam], err)
				}
				if r, ok := awaitRecord(zt, resp.Local); !ok || r.Listener != 15006 {
					t.Errorf("%s: a connection from %s, the tuple of a stale conntrack entry, was not redirected to 15006: %+v (found %v)", fam, clients[fam], r, ok)
				}
			}
		})
	}
}
