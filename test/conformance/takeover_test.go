// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// istioCNIPod is a node with one pod redirected by istio-cni's rules
// (iptables-nft, DNS capture on) and handed to the ztunnel stand-in, an
// app in the pod and one on the outside host.
func istioCNIPod(t *testing.T) (*simnode.Node, *simnode.Pod, *simnode.Ztunnel, *simnode.App, *simnode.App) {
	t.Helper()
	n := simnode.New(t)
	ref := &reference.Iptables{Backend: reference.NftCompat}
	ref.Setup(t, n)
	p := n.AddPod("taken-over")
	ref.Enroll(t, p, podopts.Options{DNSCapture: true})
	zt := n.StartZtunnel()
	zt.Add(p)
	return n, p, zt, n.StartApp(p), n.StartOutsideApp()
}

// enrolRunning enrols p, already running and served by ztunnel, in a data
// path of its own, as a takeover does.
func enrolRunning(t *testing.T, n *simnode.Node, p *simnode.Pod) {
	t.Helper()
	d, err := dataplane.New(ebpfConfig(n))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs(),
		Options: podopts.Options{DNSCapture: true}, Running: true}); err != nil {
		t.Fatal(err)
	}
}

// The data path's part of a takeover from istio-cni (pkg/takeover does it
// in this order): connections istio-cni's iptables redirected to ztunnel
// before the pod was enrolled, inbound to :15006 and outbound to :15001 in
// both families, keep flowing through the drain, the eBPF enrolment and the
// removal of istio-cni's rules, and new ones go through the eBPF
// redirection. Before 5.17 a tc program on the pod's interface captures
// inbound flows; it must leave the old ones, whose segments still carry the
// destination port conntrack translates after tc, to the stack. Once the
// old ones closed the drain has nothing left to hold.
func TestIstioCNIConnectionsLiveOnUnderTheDataPath(t *testing.T) {
	ctx := context.Background()
	n, p, zt, app, out := istioCNIPod(t)

	type stream struct {
		name     string
		app      *simnode.App
		addr     netip.AddrPort
		listener int
	}
	// open opens a stream and asserts it went through the ztunnel listener
	// given.
	open := func(s stream) {
		t.Helper()
		resp, err := s.app.Do(simnode.AppRequest{Op: "stream-open", Name: s.name, Addr: s.addr})
		if err != nil {
			t.Fatalf("%s: open: %v", s.name, err)
		}
		if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: "first"}); err != nil {
			t.Fatalf("%s: echo: %v", s.name, err)
		}
		var r standin.Record
		ok := testenv.Poll(5*time.Second, func() (found bool) { r, found = zt.RecordFor(resp.Local); return found })
		if !ok || r.Listener != s.listener || r.OrigDst != s.addr || r.Error != "" {
			t.Fatalf("%s: not through ztunnel's :%d to %s: record %+v (found %v)", s.name, s.listener, s.addr, r, ok)
		}
	}
	streams := func(prefix string) []stream {
		var ss []stream
		for fam, a := range map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}} {
			ss = append(ss,
				stream{prefix + "-outbound-" + fam, app, netip.AddrPortFrom(a[0], 7011), standin.OutboundPort},
				stream{prefix + "-inbound-" + fam, out, netip.AddrPortFrom(a[1], 7012), standin.InboundPort})
		}
		return ss
	}
	for fam, a := range map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}} {
		if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(a[0], 7011)}); err != nil {
			t.Fatalf("%s: %v", fam, err)
		}
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(a[1], 7012)}); err != nil {
			t.Fatalf("%s: %v", fam, err)
		}
	}
	old := streams("istio-cni")
	for _, s := range old {
		open(s)
	}
	redirected := func() int {
		t.Helper()
		got, err := istiocni.RedirectedFlows(ctx, p.NetnsPath())
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := redirected(); got != len(old) {
		t.Fatalf("RedirectedFlows = %d under istio-cni, want %d", got, len(old))
	}

	if err := istiocni.InstallDrain(ctx, p.NetnsPath()); err != nil {
		t.Fatal(err)
	}
	enrolRunning(t, n, p)
	echo := func(phase string, ss []stream) {
		t.Helper()
		for _, s := range ss {
			for i := range 3 {
				if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: fmt.Sprintf("%s-%d", phase, i)}); err != nil {
					t.Errorf("%s: %s: %v", s.name, phase, err)
					break
				}
			}
		}
	}
	echo("enrolled", old)
	if err := istiocni.New().RemovePod(ctx, p.NetnsPath(), istiocni.RemoveOptions{KeepReturnPath: true}); err != nil {
		t.Fatal(err)
	}
	echo("istio-cni-removed", old)

	fresh := streams("ebpf")
	for _, s := range fresh {
		open(s)
	}
	if got := redirected(); got != len(old) {
		t.Errorf("RedirectedFlows = %d after the takeover, want istio-cni's %d only", got, len(old))
	}
	for _, s := range old {
		if _, err := s.app.Do(simnode.AppRequest{Op: "stream-close", Name: s.name}); err != nil {
			t.Errorf("%s: close: %v", s.name, err)
		}
	}
	// The FIN exchange goes through ztunnel's relay before conntrack leaves
	// ESTABLISHED.
	testenv.Poll(10*time.Second, func() bool { return redirected() == 0 })
	if got := redirected(); got != 0 {
		t.Errorf("RedirectedFlows = %d once istio-cni's connections closed, want 0", got)
	}
	if err := istiocni.RemoveDrain(ctx, p.NetnsPath()); err != nil {
		t.Fatal(err)
	}
	echo("drain-removed", fresh)
}

// A client comes back from the port of a connection istio-cni's REDIRECT
// sent to ztunnel before the takeover, while ztunnel's accepted socket of
// that connection (pod:15006 <-> client:port: the server side closed first)
// is still in TIME_WAIT. The new connection is the eBPF path's, and is
// captured like any other. Before 5.17 the pod's tc program looked up the
// :15006 listener with the flow's own client address and port, met that
// TIME_WAIT socket instead of the listener, and dropped the SYN and every
// retransmission until TIME_WAIT ended (the takeover suite's lost inbound
// connections on 5.10). From 5.17 on sk_lookup captures, and no tc program
// is on the pod's interface.
func TestAClientBackFromThePortOfAnIstioCNIConnection(t *testing.T) {
	ctx := context.Background()
	n, p, zt, app, out := istioCNIPod(t)
	const port = 7013
	app.Listen("tcp", "app", netip.AddrPortFrom(netip.IPv6Unspecified(), port))

	fams := []struct {
		name     string
		src, dst netip.AddrPort
	}{
		{"ipv4", netip.AddrPortFrom(simnode.OutsideV4, simnode.FixedClientPort+13), netip.AddrPortFrom(p.V4, port)},
		{"ipv6", netip.AddrPortFrom(simnode.OutsideV6, simnode.FixedClientPort+13), netip.AddrPortFrom(p.V6, port)},
	}
	// dial connects from f.src, waits for the server side to close first,
	// and checks the connection went through ztunnel's :15006 to f.dst.
	dial := func(phase string, f struct {
		name     string
		src, dst netip.AddrPort
	}) {
		t.Helper()
		start := time.Now()
		resp, err := out.Dial("tcp", simnode.AppRequest{Addr: f.dst, Bind: f.src, WaitEOF: true})
		if err != nil {
			t.Fatalf("%s %s: %v", phase, f.name, err)
		}
		// ztunnel keeps the client's address, not its port (R10).
		if resp.Reply == nil || resp.Reply.Server != "app" || resp.Reply.Peer.Addr() != f.src.Addr() {
			t.Errorf("%s %s: answered by %+v, want the app seeing %s", phase, f.name, resp.Reply, f.src.Addr())
		}
		// This connection's record: the stand-in's first of f.src is the
		// earlier connection's.
		var r standin.Record
		ok := testenv.Poll(5*time.Second, func() (found bool) {
			for _, rec := range zt.Records() {
				if rec.Peer == f.src && !rec.Time.Before(start) {
					r, found = rec, true
				}
			}
			return found
		})
		if !ok || r.Listener != standin.InboundPort || r.OrigDst != f.dst || r.Error != "" {
			t.Errorf("%s %s: not through ztunnel's :%d to %s: record %+v (found %v)", phase, f.name, standin.InboundPort, f.dst, r, ok)
		}
	}
	for _, f := range fams {
		dial("istio-cni", f)
		if !timeWaitIn(t, p, f.src) {
			t.Fatalf("%s: no TIME_WAIT socket of %s in the pod: the scenario did not set up its condition", f.name, f.src)
		}
	}

	if err := istiocni.InstallDrain(ctx, p.NetnsPath()); err != nil {
		t.Fatal(err)
	}
	enrolRunning(t, n, p)
	if err := istiocni.New().RemovePod(ctx, p.NetnsPath(), istiocni.RemoveOptions{KeepReturnPath: true}); err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if !timeWaitIn(t, p, f.src) {
			t.Fatalf("%s: the TIME_WAIT socket of %s went before the takeover was done", f.name, f.src)
		}
		dial("taken over", f)
	}
}
