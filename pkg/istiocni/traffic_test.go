// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// The takeover's drain: connections redirected by istio-cni's REDIRECT
// rules, outbound to ztunnel's 15001 and inbound to its 15006, both
// families, keep working after RemovePod when the drain was installed
// first; RedirectedFlows counts them down to 0 as they close, and
// RemoveDrain then leaves nothing. Without the drain (the control) every
// one of them is reset: removing istio-cni's rules turns conntrack off in
// the pod (see DrainTable).
func TestDrainKeepsRedirectedConnections(t *testing.T) {
	for _, b := range []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat} {
		t.Run(string(b), func(t *testing.T) { drainTakeover(t, b, true) })
		t.Run(string(b)+"/without-drain", func(t *testing.T) { drainTakeover(t, b, false) })
	}
}

// stream is one long-lived connection through ztunnel: opened by app, the
// pod's app (outbound) or the outside host's (inbound).
type stream struct {
	name string
	app  *simnode.App
	port int // the ztunnel listener it went through
}

func drainTakeover(t *testing.T, b istiocni.Backend, drain bool) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	p := n.AddPod("drain")
	applyInpod(t, p.NetnsPath(), b, podopts.Options{DNSCapture: true})
	zt := n.StartZtunnel()
	zt.Add(p)
	out := n.StartOutsideApp()
	app := n.StartApp(p)

	var streams []stream
	open := func(s stream, addr netip.AddrPort) {
		t.Helper()
		resp, err := s.app.Do(simnode.AppRequest{Op: "stream-open", Name: s.name, Addr: addr})
		if err != nil {
			t.Fatalf("%s: open the stream: %v", s.name, err)
		}
		r, ok := awaitRecord(zt, resp.Local)
		if !ok || r.OrigDst != addr || r.Listener != s.port || r.Error != "" {
			t.Fatalf("%s: the stream did not go through ztunnel's %d: %+v", s.name, s.port, r)
		}
		if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: "before"}); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		streams = append(streams, s)
	}
	for fam, a := range map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}} {
		outside, pod := netip.AddrPortFrom(a[0], 7007), netip.AddrPortFrom(a[1], 7008)
		if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: outside}); err != nil {
			t.Fatal(err)
		}
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: pod}); err != nil {
			t.Fatal(err)
		}
		open(stream{"outbound-" + fam, app, standin.OutboundPort}, outside)
		open(stream{"inbound-" + fam, out, standin.InboundPort}, pod)
	}
	flows(t, p, len(streams))

	if drain {
		for range 2 { // idempotent
			if err := istiocni.InstallDrain(ctx, p.NetnsPath()); err != nil {
				t.Fatal(err)
			}
		}
		if got := sh(t, p.NetnsPath(), "", "nft", "list", "table", "inet", istiocni.DrainTable); strings.Count(got, "ct state established,related accept") != 4 ||
			!strings.Contains(got, "ct mark & 0x00000fff == 0x00000111 meta mark set ct mark") {
			t.Errorf("the drain table as nft lists it:\n%s", got)
		}
	}
	if err := mgr.RemovePod(ctx, p.NetnsPath(), istiocni.RemoveOptions{KeepReturnPath: true}); err != nil {
		t.Fatal(err)
	}
	noIstio(t, p.NetnsPath())
	for _, s := range streams {
		for i := range 3 {
			_, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: fmt.Sprintf("after-%d", i)})
			if drain && err != nil {
				t.Errorf("%s: the established stream broke after Remove with the drain: %v", s.name, err)
			}
			if !drain && i == 0 && err == nil {
				t.Errorf("%s: the established stream survived Remove without the drain: conntrack stayed on in the pod", s.name)
			}
			if err != nil {
				break
			}
		}
	}
	if !drain {
		return
	}
	// New connections are not redirected any more (the eBPF enrolment's job).
	for fam, addr := range map[string]netip.AddrPort{"ipv4": netip.AddrPortFrom(simnode.OutsideV4, 7007), "ipv6": netip.AddrPortFrom(simnode.OutsideV6, 7007)} {
		resp, err := app.Do(simnode.AppRequest{Op: "stream-open", Name: fam + "-new", Addr: addr})
		if err != nil {
			t.Fatalf("%s: a new connection after Remove: %v", fam, err)
		}
		if r, ok := zt.RecordFor(resp.Local); ok {
			t.Errorf("%s: a new connection after Remove was still redirected: %+v", fam, r)
		}
		if _, err := app.Do(simnode.AppRequest{Op: "stream-echo", Name: fam + "-new", DNSName: "direct"}); err != nil {
			t.Errorf("%s: the new, direct connection: %v", fam, err)
		}
		if _, err := app.Do(simnode.AppRequest{Op: "stream-close", Name: fam + "-new"}); err != nil {
			t.Error(err)
		}
	}
	flows(t, p, len(streams))
	for i, s := range streams {
		if _, err := s.app.Do(simnode.AppRequest{Op: "stream-close", Name: s.name}); err != nil {
			t.Fatal(err)
		}
		waitFlows(t, p, len(streams)-i-1)
	}
	for range 2 { // idempotent
		if err := istiocni.RemoveDrain(ctx, p.NetnsPath()); err != nil {
			t.Fatal(err)
		}
	}
	if got := sh(t, p.NetnsPath(), "", "nft", "list", "ruleset"); strings.Contains(got, istiocni.DrainTable) {
		t.Errorf("nft list ruleset after RemoveDrain:\n%s", got)
	}
	if has, err := istiocni.HasDrain(ctx, p.NetnsPath()); err != nil || has {
		t.Errorf("HasDrain after RemoveDrain: %v %v", has, err)
	}
}

// awaitRecord is ztunnel's record of the connection from peer, waited
// for: the stand-in writes it as it accepts, after the client's connect
// has returned.
func awaitRecord(zt *simnode.Ztunnel, peer netip.AddrPort) (standin.Record, bool) {
	var r standin.Record
	ok := testenv.Poll(5*time.Second, func() (found bool) { r, found = zt.RecordFor(peer); return found })
	return r, ok
}

func flows(t *testing.T, p *simnode.Pod, want int) {
	t.Helper()
	got, err := istiocni.RedirectedFlows(context.Background(), p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("RedirectedFlows = %d, want %d; conntrack:\n%s", got, want, sh(t, p.NetnsPath(), "", "cat", "/proc/net/nf_conntrack"))
	}
}

// waitFlows waits for a closed stream's entry to leave ESTABLISHED (the
// FIN exchange goes through ztunnel's relay).
func waitFlows(t *testing.T, p *simnode.Pod, want int) {
	t.Helper()
	if testenv.Poll(5*time.Second, func() bool {
		got, err := istiocni.RedirectedFlows(context.Background(), p.NetnsPath())
		return err == nil && got == want
	}) {
		return
	}
	flows(t, p, want)
}
