// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni_test

import (
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

var (
	podBackends = []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat, istiocni.Nftables}
	short       = map[istiocni.Backend]string{istiocni.Legacy: "leg", istiocni.NftCompat: "xnft", istiocni.Nftables: "nft"}
)

// The hand-back: a pod whose connections were made while istio-cni's
// rules were absent (no conntrack in the pod, as under eBPF redirection:
// handback_test.go's state, the ztunnel stand-in listening in the pod)
// gets istio-cni's rules from ApplyPod. Its long-lived streams, inbound
// and outbound, both families, keep working; new connections are
// redirected by the rules; InspectPod says Equivalent; a second ApplyPod
// changes nothing.
func TestApplyPodKeepsEstablishedConnections(t *testing.T) {
	for _, b := range podBackends {
		t.Run(string(b), func(t *testing.T) { applyPodLive(t, b) })
	}
}

func applyPodLive(t *testing.T, b istiocni.Backend) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	p := n.AddPod("apply-" + short[b])
	ns := p.NetnsPath()
	zt := n.StartZtunnel()
	zt.Add(p)
	out := n.StartOutsideApp()
	app := n.StartApp(p)
	// The eBPF enrolment's return path, the same as istio-cni's.
	applyReturnPath(t, ns)

	type live struct {
		name string
		app  *simnode.App
		peer netip.AddrPort // the client's address, as ztunnel would record it
	}
	var streams []live
	for fam, a := range map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}} {
		outside, pod := netip.AddrPortFrom(a[0], 7007), netip.AddrPortFrom(a[1], 7008)
		if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: outside}); err != nil {
			t.Fatal(err)
		}
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: pod}); err != nil {
			t.Fatal(err)
		}
		for _, s := range []struct {
			name string
			app  *simnode.App
			addr netip.AddrPort
		}{{"outbound-" + fam, app, outside}, {"inbound-" + fam, out, pod}} {
			resp, err := s.app.Do(simnode.AppRequest{Op: "stream-open", Name: s.name, Addr: s.addr})
			if err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: "before"}); err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			if r, ok := zt.RecordFor(resp.Local); ok {
				t.Fatalf("%s: redirected before istio-cni's rules: %+v", s.name, r)
			}
			streams = append(streams, live{s.name, s.app, resp.Local})
		}
	}

	o := podopts.Options{DNSCapture: true}
	if err := mgr.ApplyPod(ctx, ns, b, o); err != nil {
		t.Fatal(err)
	}
	for _, s := range streams {
		for i := range 2 {
			if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: fmt.Sprintf("after-%d", i)}); err != nil {
				t.Errorf("%s: the established stream broke when istio-cni's rules came: %v", s.name, err)
				break
			}
		}
		if r, ok := zt.RecordFor(s.peer); ok {
			t.Errorf("%s: the established stream was picked up by ztunnel: %+v", s.name, r)
		}
	}
	got, err := mgr.InspectPod(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equivalent || !got.Options.Equal(o) || !slices.Equal(got.Backends(), []istiocni.Backend{b}) {
		t.Errorf("after ApplyPod: equivalent %t, options %s (want %s), backends %v, reasons %q", got.Equivalent, got.Options, o, got.Backends(), got.Reasons)
	}
	if has, err := istiocni.HasDrain(ctx, ns); err != nil || has {
		t.Errorf("the drain after ApplyPod: %t, %v", has, err)
	}

	// New connections go through istio-cni's redirection.
	for fam, a := range map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}} {
		for _, s := range []struct {
			name string
			app  *simnode.App
			addr netip.AddrPort
			port int
		}{{"new-outbound-" + fam, app, netip.AddrPortFrom(a[0], 7007), standin.OutboundPort}, {"new-inbound-" + fam, out, netip.AddrPortFrom(a[1], 7008), standin.InboundPort}} {
			resp, err := s.app.Do(simnode.AppRequest{Op: "stream-open", Name: s.name, Addr: s.addr})
			if err != nil {
				t.Fatalf("%s: %v", s.name, err)
			}
			r, ok := awaitRecord(zt, resp.Local)
			if !ok || r.Listener != s.port || r.OrigDst != s.addr {
				t.Errorf("%s: not redirected to ztunnel's %d: %v %+v", s.name, s.port, ok, r)
			}
			if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: "new"}); err != nil {
				t.Errorf("%s: %v", s.name, err)
			}
		}
	}

	before := rulesetOf(t, ns)
	if err := mgr.ApplyPod(ctx, ns, b, o); err != nil {
		t.Fatalf("a second ApplyPod: %v", err)
	}
	if after := rulesetOf(t, ns); after != before {
		t.Errorf("a second ApplyPod changed the pod:\n got: %s\nwant: %s", after, before)
	}
	for _, s := range streams {
		if _, err := s.app.Do(simnode.AppRequest{Op: "stream-echo", Name: s.name, DNSName: "again"}); err != nil {
			t.Errorf("%s: after the second ApplyPod: %v", s.name, err)
		}
	}
}

var nftCounters = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// rulesetOf is every backend's and family's iptables-save, the nft
// ruleset, the policy rules and routes: counters zeroed.
func rulesetOf(t *testing.T, ns string) string {
	var b strings.Builder
	for _, tool := range []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"} {
		b.WriteString("== " + tool + "\n" + chainCount.ReplaceAllString(commentLine.ReplaceAllString(sh(t, ns, "", tool), ""), "[0:0]"))
	}
	b.WriteString("== nft\n" + nftCounters.ReplaceAllString(sh(t, ns, "", "nft", "list", "ruleset"), "counter"))
	for _, args := range [][]string{{"-4", "rule"}, {"-6", "rule"}, {"-4", "route", "show", "table", "all"}, {"-6", "route", "show", "table", "all"}} {
		b.WriteString("== ip " + strings.Join(args, " ") + "\n" + sh(t, ns, "", append([]string{"ip"}, args...)...))
	}
	return b.String()
}

// ApplyPod leaves everyone else's rules alone, adds the return path when
// it is missing, is idempotent for every option set, and RemovePod then
// takes the pod back to where it was.
func TestApplyPodOptions(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	for _, b := range podBackends {
		for name, o := range optionSets {
			t.Run(string(b)+"/"+name, func(t *testing.T) {
				p := n.AddBarePod("ap-"+short[b]+"-"+name, "default", "uid-ap-"+short[b]+"-"+name)
				ns := p.NetnsPath()
				unrelated(t, ns)
				before := snapshot(t, ns)
				if err := mgr.ApplyPod(ctx, ns, b, o); err != nil {
					t.Fatal(err)
				}
				got, err := mgr.InspectPod(ctx, ns)
				if err != nil {
					t.Fatal(err)
				}
				if !got.Equivalent || !got.Options.Equal(o) || !slices.Equal(got.Backends(), []istiocni.Backend{b}) {
					t.Errorf("equivalent %t, options %s (want %s), backends %v, reasons %q", got.Equivalent, got.Options, o, got.Backends(), got.Reasons)
				}
				applied := snapshot(t, ns)
				for _, l := range strings.Split(before, "\n") {
					if !strings.Contains(applied, l) {
						t.Errorf("ApplyPod took %q out of the pod:\n%s", l, applied)
					}
				}
				if err := mgr.ApplyPod(ctx, ns, b, o); err != nil {
					t.Fatalf("a second ApplyPod: %v", err)
				}
				if again := snapshot(t, ns); again != applied {
					t.Errorf("a second ApplyPod changed the pod:\n got: %s\nwant: %s", again, applied)
				}
				if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
					t.Fatal(err)
				}
				if after := snapshot(t, ns); after != before {
					t.Errorf("ApplyPod then RemovePod left the pod changed:\n got: %s\nwant: %s", after, before)
				}
			})
		}
	}
	// Other options replace the rules, not add to them.
	t.Run("change-options", func(t *testing.T) {
		p := n.AddBarePod("ap-change", "default", "uid-ap-change")
		ns := p.NetnsPath()
		for _, o := range []podopts.Options{{}, {DNSCapture: true, RerouteInterfaces: []string{"vm0"}}, {BypassInbound: true}} {
			if err := mgr.ApplyPod(ctx, ns, istiocni.NftCompat, o); err != nil {
				t.Fatal(err)
			}
			if got, err := mgr.InspectPod(ctx, ns); err != nil || !got.Equivalent || !got.Options.Equal(o) {
				t.Fatalf("after ApplyPod with %s: %+v, %v", o, got, err)
			}
		}
	})
	// The pod's rules in another backend are not doubled.
	t.Run("other-backend", func(t *testing.T) {
		p := n.AddBarePod("ap-other", "default", "uid-ap-other")
		ns := p.NetnsPath()
		unrelated(t, ns)
		applyInpod(t, ns, istiocni.Legacy, podopts.Options{})
		before := snapshot(t, ns)
		err := mgr.ApplyPod(ctx, ns, istiocni.NftCompat, podopts.Options{})
		if err == nil || !strings.Contains(err.Error(), string(istiocni.Legacy)) || !strings.Contains(err.Error(), ns) {
			t.Errorf("ApplyPod over another backend's rules: %v", err)
		}
		if after := snapshot(t, ns); after != before {
			t.Errorf("a refused ApplyPod changed the pod:\n got: %s\nwant: %s", after, before)
		}
	})
}

// A failed ApplyPod leaves nothing behind: a reroute interface name
// iptables and nft refuse (longer than IFNAMSIZ) fails the nat table's
// restore after the legacy backend committed mangle.
func TestApplyPodRollsBack(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	bad := podopts.Options{RerouteInterfaces: []string{"this-name-is-too-long"}}
	for _, b := range podBackends {
		t.Run(string(b), func(t *testing.T) {
			for _, enrolled := range []bool{false, true} {
				name := fmt.Sprintf("rb-%s-%t", short[b], enrolled)
				p := n.AddBarePod(name, "default", "uid-"+name)
				ns := p.NetnsPath()
				unrelated(t, ns)
				if enrolled {
					applyReturnPath(t, ns) // the eBPF enrolment's: kept
				}
				before := snapshot(t, ns)
				err := mgr.ApplyPod(ctx, ns, b, bad)
				if err == nil {
					t.Fatal("ApplyPod with an invalid interface name succeeded")
				}
				t.Logf("enrolled %t: %v", enrolled, err)
				cmd := "nft"
				if b != istiocni.Nftables {
					cmd = "iptables" + suffix[b] + "-restore"
				}
				for _, want := range []string{ns, string(b), "nat", cmd} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("the error does not name %q: %v", want, err)
					}
				}
				if after := snapshot(t, ns); after != before {
					t.Errorf("a failed ApplyPod left the pod changed:\n got: %s\nwant: %s", after, before)
				}
				if has, err := istiocni.HasDrain(ctx, ns); err != nil || has {
					t.Errorf("the drain after a failed ApplyPod: %t, %v", has, err)
				}
			}
		})
	}
}

// ApplyNode and AddProbeEntries write istio-cni's host state (idempotent,
// InspectNode matches); RemoveProbeEntries and RemoveNode take the node
// netns back to where it was.
func TestApplyNodeRoundTrip(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	for _, b := range []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat} {
		t.Run(string(b), func(t *testing.T) {
			n := simnode.New(t)
			node := simnode.NetnsPath(n.NodeNS)
			unrelated(t, node)
			before := netfilterSnapshot(t, node)
			sets := sh(t, node, "", "ipset", "list", "-n")
			ips := []netip.Addr{netip.MustParseAddr("198.18.7.7"), netip.MustParseAddr("fd00:198:18::7:7")}
			var applied string
			for i := range 2 {
				if err := mgr.ApplyNode(ctx, node, b); err != nil {
					t.Fatal(err)
				}
				if err := mgr.AddProbeEntries(ctx, node, "uid-probed", ips); err != nil {
					t.Fatal(err)
				}
				now := netfilterSnapshot(t, node) + sh(t, node, "", "ipset", "list")
				if i == 1 && now != applied {
					t.Errorf("a second ApplyNode/AddProbeEntries changed the node:\n got: %s\nwant: %s", now, applied)
				}
				applied = now
			}
			for _, set := range []string{istiocni.ProbeSetV4, istiocni.ProbeSetV6} {
				if list := sh(t, node, "", "ipset", "list", set); !strings.Contains(list, "Type: hash:ip") || !strings.Contains(list, `comment "uid-probed"`) {
					t.Errorf("ipset %s:\n%s", set, list)
				}
			}
			for _, tool := range []string{"iptables", "ip6tables"} {
				save := sh(t, node, "", tool+suffix[b]+"-save", "-t", "nat")
				i := strings.Index(save, "-A POSTROUTING ")
				if i < 0 || !strings.HasPrefix(save[i:], "-A POSTROUTING -j ISTIO_POSTRT\n") {
					t.Errorf("%s: ISTIO_POSTRT is not jumped to first in POSTROUTING:\n%s", tool, save)
				}
			}
			got, err := mgr.InspectNode(ctx, node)
			if err != nil {
				t.Fatal(err)
			}
			if len(got.Iptables) != 2 || got.Entries() != 2 || got.IPSets[istiocni.ProbeSetV4] != 1 || got.IPSets[istiocni.ProbeSetV6] != 1 || got.NftTable {
				t.Errorf("InspectNode after ApplyNode: %+v", got)
			}
			for _, r := range got.Iptables {
				if r.Backend != b || !r.Exact || !slices.Equal(r.Jumps, []string{"nat: -A POSTROUTING -j ISTIO_POSTRT"}) {
					t.Errorf("%s %s: exact %t (%s), jumps %q", r.Backend, r.Family, r.Exact, r.Diff, r.Jumps)
				}
			}
			if err := mgr.RemoveProbeEntries(ctx, node, "uid-probed", ips); err != nil {
				t.Fatal(err)
			}
			if err := mgr.RemoveNode(ctx, node); err != nil {
				t.Fatal(err)
			}
			if after := netfilterSnapshot(t, node); after != before {
				t.Errorf("after the round trip the node differs:\n got: %s\nwant: %s", after, before)
			}
			if after := sh(t, node, "", "ipset", "list", "-n"); after != sets {
				t.Errorf("ipsets after the round trip: %q, want %q", after, sets)
			}
		})
	}
	t.Run("nftables", func(t *testing.T) {
		n := simnode.New(t)
		node := simnode.NetnsPath(n.NodeNS)
		unrelated(t, node)
		before := netfilterSnapshot(t, node)
		err := mgr.ApplyNode(ctx, node, istiocni.Nftables)
		if err == nil || !strings.Contains(err.Error(), "nftables") || !strings.Contains(err.Error(), node) {
			t.Errorf("ApplyNode with nftables: %v, want it refused", err)
		}
		if after := netfilterSnapshot(t, node); after != before {
			t.Errorf("a refused ApplyNode changed the node:\n got: %s\nwant: %s", after, before)
		}
	})
}
