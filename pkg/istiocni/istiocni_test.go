// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func TestMain(m *testing.M) {
	simnode.RunHelper() // the traffic test's helper processes
	os.Exit(m.Run())
}

var optionSets = map[string]podopts.Options{
	"default":         {},
	"dns":             {DNSCapture: true},
	"ingress":         {BypassInbound: true},
	"reroute-dns":     {DNSCapture: true, RerouteInterfaces: []string{"vm0", "vm1"}},
	"ingress-reroute": {BypassInbound: true, RerouteInterfaces: []string{"vm0"}},
}

// The package's renderer writes, rule for rule, what the test reference
// (held to istio-cni's own generator) applies.
func TestRenderMatchesReference(t *testing.T) {
	for name, o := range optionSets {
		if got, want := istiocni.RenderInpod(o, istiocni.IPv4), rules.Inpod(o, rules.Loopback4, rules.Probe4); got != want {
			t.Errorf("%s ipv4:\n got: %s\nwant: %s", name, got, want)
		}
		if got, want := istiocni.RenderInpod(o, istiocni.IPv6), rules.Inpod(o, rules.Loopback6, rules.Probe6); got != want {
			t.Errorf("%s ipv6:\n got: %s\nwant: %s", name, got, want)
		}
	}
	if got, want := istiocni.RenderHost(istiocni.IPv4), rules.Host(rules.IpsetV4, rules.Probe4, true); got != want {
		t.Errorf("host ipv4:\n got: %s\nwant: %s", got, want)
	}
	if got, want := istiocni.RenderHost(istiocni.IPv6), rules.Host(rules.IpsetV6, rules.Probe6, true); got != want {
		t.Errorf("host ipv6:\n got: %s\nwant: %s", got, want)
	}
	if istiocni.ProbeSetV4 != rules.IpsetV4 || istiocni.ProbeSetV6 != rules.IpsetV6 ||
		istiocni.ChainPrerouting != rules.ChainPrerouting || istiocni.ChainOutput != rules.ChainOutput || istiocni.ChainHostPostrouting != rules.ChainHostPostrouting {
		t.Error("chain or ipset names differ from the reference's")
	}
}

func sh(t *testing.T, ns, stdin string, args ...string) string {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + ns}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), ns, err, out)
	}
	return string(out)
}

var suffix = map[istiocni.Backend]string{istiocni.Legacy: "-legacy", istiocni.NftCompat: "-nft"}

// applyInpod applies the reference's in-pod rules with one backend, and
// the return path, as istio-cni does.
func applyInpod(t *testing.T, ns string, b istiocni.Backend, o podopts.Options) {
	sh(t, ns, rules.Inpod(o, rules.Loopback4, rules.Probe4), "iptables"+suffix[b]+"-restore", "--noflush")
	sh(t, ns, rules.Inpod(o, rules.Loopback6, rules.Probe6), "ip6tables"+suffix[b]+"-restore", "--noflush")
	applyReturnPath(t, ns)
}

func applyReturnPath(t *testing.T, ns string) {
	for _, fam := range []string{"-4", "-6"} {
		sh(t, ns, "", "ip", fam, "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
	}
	sh(t, ns, "", "ip", "-4", "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	sh(t, ns, "", "ip", "-6", "route", "replace", "local", "::/0", "dev", "lo", "table", "100")
}

// unrelated installs someone else's rules: kube-proxy's and a CNI's kind,
// with a user chain, in both backends and families, and an nft table.
func unrelated(t *testing.T, ns string) {
	for _, b := range []string{"-legacy", "-nft"} {
		for _, tool := range []string{"iptables", "ip6tables"} {
			sh(t, ns, "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n-A OUTPUT -j KUBE-SERVICES\n-A PREROUTING -j KUBE-SERVICES\n"+
				"-I POSTROUTING 1 -j KUBE-POSTROUTING\n-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE\nCOMMIT\n"+
				"*mangle\n:USER-MARK - [0:0]\n-A PREROUTING -j USER-MARK\n-A USER-MARK -p tcp --dport 9 -j MARK --set-xmark 0x7/0xff\nCOMMIT\n"+
				"*raw\n-A OUTPUT -p udp --dport 5353 -j NOTRACK\nCOMMIT\n", tool+b+"-restore", "--noflush")
		}
	}
	sh(t, ns, "table inet user {\n chain out {\n  type filter hook output priority 10; policy accept;\n  tcp dport 9 counter\n }\n}\n", "nft", "-f", "-")
}

var (
	commentLine = regexp.MustCompile(`(?m)^#.*\n`)
	chainCount  = regexp.MustCompile(`\[\d+:\d+\]`)
)

// snapshot is every backend's and family's iptables-save, the nft ruleset
// outside iptables-nft's tables, the policy rules and table 100: tables
// only touched (listed empty) are left out, counters zeroed.
func snapshot(t *testing.T, ns string) string { return snapshotOf(t, ns, true) }

// netfilterSnapshot leaves the routes out: the node gains pod routes.
func netfilterSnapshot(t *testing.T, ns string) string { return snapshotOf(t, ns, false) }

func snapshotOf(t *testing.T, ns string, routing bool) string {
	var b strings.Builder
	for _, tool := range []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"} {
		out := chainCount.ReplaceAllString(commentLine.ReplaceAllString(sh(t, ns, "", tool), ""), "[0:0]")
		b.WriteString("== " + tool + "\n")
		for _, table := range strings.SplitAfter(out, "COMMIT\n") {
			if strings.Contains(table, "\n-A ") || strings.Contains(table, " - [0:0]") {
				b.WriteString(table)
			}
		}
	}
	b.WriteString("== nft inet user\n" + sh(t, ns, "", "nft", "list", "table", "inet", "user"))
	if !routing {
		return b.String()
	}
	for _, args := range [][]string{{"-4", "rule"}, {"-6", "rule"}, {"-4", "route", "show", "table", "all"}, {"-6", "route", "show", "table", "all"}} {
		b.WriteString("== ip " + strings.Join(args, " ") + "\n" + sh(t, ns, "", append([]string{"ip"}, args...)...))
	}
	return b.String()
}

func noIstio(t *testing.T, ns string) {
	t.Helper()
	for _, tool := range []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"} {
		if out := sh(t, ns, "", tool); strings.Contains(out, "ISTIO") {
			t.Errorf("%s after Remove still shows istio-cni's rules:\n%s", tool, out)
		}
	}
	if out := sh(t, ns, "", "nft", "list", "ruleset"); strings.Contains(out, "ISTIO") || strings.Contains(out, "istio") {
		t.Errorf("nft list ruleset after Remove still shows istio-cni's rules:\n%s", out)
	}
}

func TestInspectAndRemovePod(t *testing.T) {
	testenv.RequireRoot(t) // before the tools: make test-unit runs it unprivileged
	ctx := context.Background()
	mgr := istiocni.New()
	if m := mgr.Missing(); len(m) > 0 {
		t.Fatalf("binaries missing: %v (make deps installs iptables and nftables)", m)
	}
	n := simnode.New(t)
	for _, b := range []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat} {
		for name, o := range optionSets {
			t.Run(string(b)+"/"+name, func(t *testing.T) {
				p := n.AddBarePod("p-"+suffix[b][1:]+"-"+name, "default", "uid-"+suffix[b][1:]+"-"+name)
				ns := p.NetnsPath()
				unrelated(t, ns)
				before := snapshot(t, ns)
				if got, err := mgr.InspectPod(ctx, ns); err != nil || got.Found() {
					t.Fatalf("before istio-cni: found %+v, %v", got, err)
				}
				applyInpod(t, ns, b, o)
				got, err := mgr.InspectPod(ctx, ns)
				if err != nil {
					t.Fatal(err)
				}
				if !got.Found() || !got.Equivalent || len(got.Reasons) != 0 {
					t.Errorf("found %t equivalent %t, reasons %q", got.Found(), got.Equivalent, got.Reasons)
				}
				if bs := got.Backends(); !slices.Equal(bs, []istiocni.Backend{b}) {
					t.Errorf("backends %v, want [%s]", bs, b)
				}
				if len(got.Iptables) != 2 || got.Iptables[0].Family != "ipv4" || got.Iptables[1].Family != "ipv6" {
					t.Fatalf("iptables state %+v, want ipv4 and ipv6", got.Iptables)
				}
				wantChains := []string{"mangle/ISTIO_PRERT", "mangle/ISTIO_OUTPUT", "nat/ISTIO_PRERT", "nat/ISTIO_OUTPUT"}
				if o.DNSCapture {
					wantChains = append(wantChains, "raw/ISTIO_PRERT", "raw/ISTIO_OUTPUT")
				}
				for _, r := range got.Iptables {
					if !r.Exact || r.Diff != "" {
						t.Errorf("%s: not exact: %s", r.Family, r.Diff)
					}
					if !r.Options.Equal(o) {
						t.Errorf("%s: options %s, want %s", r.Family, r.Options, o)
					}
					slices.Sort(r.Chains)
					w := slices.Clone(wantChains)
					slices.Sort(w)
					if !slices.Equal(r.Chains, w) {
						t.Errorf("%s: chains %v, want %v", r.Family, r.Chains, w)
					}
					if len(r.Jumps) != len(wantChains) {
						t.Errorf("%s: jumps %v, want one per chain", r.Family, r.Jumps)
					}
				}
				if !got.Options.Equal(o) {
					t.Errorf("options %s, want %s", got.Options, o)
				}
				if !got.Rule4 || !got.Rule6 || !got.Route4 || !got.Route6 || len(got.OtherRoutes) != 0 || got.Nft != nil {
					t.Errorf("return path %t %t %t %t, other routes %v, nft %+v", got.Rule4, got.Rule6, got.Route4, got.Route6, got.OtherRoutes, got.Nft)
				}

				if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
					t.Fatal(err)
				}
				noIstio(t, ns)
				if after := snapshot(t, ns); after != before {
					t.Errorf("after Remove the pod's other state differs:\n got: %s\nwant: %s", after, before)
				}
				if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
					t.Errorf("a second Remove: %v", err)
				}
				if got, err := mgr.InspectPod(ctx, ns); err != nil || got.Found() {
					t.Errorf("after Remove: found %+v, %v", got, err)
				}
			})
		}
	}
}

// KeepReturnPath leaves the policy rule and routes the eBPF enrolment
// shares with istio-cni.
func TestRemoveKeepsReturnPath(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	p := n.AddBarePod("keep", "default", "uid-keep")
	applyInpod(t, p.NetnsPath(), istiocni.NftCompat, podopts.Options{DNSCapture: true})
	if err := mgr.RemovePod(ctx, p.NetnsPath(), istiocni.RemoveOptions{KeepReturnPath: true}); err != nil {
		t.Fatal(err)
	}
	got, err := mgr.InspectPod(ctx, p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Iptables) != 0 || !got.Rule4 || !got.Rule6 || !got.Route4 || !got.Route6 {
		t.Errorf("after Remove keeping the return path: %+v", got)
	}
	if got.Equivalent || len(got.Reasons) == 0 {
		t.Errorf("a lone return path is reported equivalent")
	}
}

// A rule set that is not istio-cni's is reported, with the difference.
func TestNotEquivalent(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	cases := map[string]struct {
		edit func(t *testing.T, ns string)
		want string
	}{
		"hand-edited": {func(t *testing.T, ns string) {
			sh(t, ns, "", "iptables-nft", "-t", "nat", "-I", "ISTIO_OUTPUT", "1", "-d", "198.18.9.9", "-j", "RETURN")
		}, "not the rules istio-cni writes"},
		"rule-missing": {func(t *testing.T, ns string) {
			sh(t, ns, "", "ip6tables-nft", "-t", "mangle", "-D", "ISTIO_PRERT", "1")
		}, "not the rules istio-cni writes"},
		"both-backends-ipv4-only-in-one": {func(t *testing.T, ns string) {
			sh(t, ns, rules.Inpod(podopts.Options{}, rules.Loopback4, rules.Probe4), "iptables-legacy-restore", "--noflush")
		}, "more than one backend, for other families"},
		"both-backends-other-options": {func(t *testing.T, ns string) {
			sh(t, ns, rules.Inpod(podopts.Options{DNSCapture: true}, rules.Loopback4, rules.Probe4), "iptables-legacy-restore", "--noflush")
			sh(t, ns, rules.Inpod(podopts.Options{DNSCapture: true}, rules.Loopback6, rules.Probe6), "ip6tables-legacy-restore", "--noflush")
		}, "other options"},
		"no-route": {func(t *testing.T, ns string) {
			sh(t, ns, "", "ip", "-6", "route", "del", "local", "::/0", "dev", "lo", "table", "100")
		}, "IPv6 return path"},
		"older-layout-tproxy": {func(t *testing.T, ns string) {
			sh(t, ns, "", "iptables-nft", "-t", "mangle", "-A", "ISTIO_PRERT", "-p", "tcp", "-j", "TPROXY", "--on-port", "15006", "--tproxy-mark", "0x111/0xfff")
		}, "not the rules istio-cni writes"},
	}
	for name, c := range cases {
		t.Run(name, func(t *testing.T) {
			p := n.AddBarePod("ne-"+name, "default", "uid-ne-"+name)
			applyInpod(t, p.NetnsPath(), istiocni.NftCompat, podopts.Options{})
			c.edit(t, p.NetnsPath())
			got, err := mgr.InspectPod(ctx, p.NetnsPath())
			if err != nil {
				t.Fatal(err)
			}
			if !got.Found() || got.Equivalent || !strings.Contains(strings.Join(got.Reasons, "\n"), c.want) {
				t.Errorf("found %t equivalent %t, reasons %q, want one with %q", got.Found(), got.Equivalent, got.Reasons, c.want)
			}
		})
	}
}

// istio-cni restarted on a kernel with legacy iptables writes its rules
// again in iptables-legacy, keeping the iptables-nft ones
// (istio/istio#61020; test/takeover's real istio-cni shows it): one rule
// set in both backends is still istio-cni's, and RemovePod takes out both.
func TestRulesIstioCNIWroteInBothBackends(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	p := n.AddBarePod("both", "default", "uid-both")
	ns := p.NetnsPath()
	unrelated(t, ns)
	before := snapshot(t, ns)
	o := podopts.Options{DNSCapture: true}
	applyInpod(t, ns, istiocni.NftCompat, o)
	sh(t, ns, rules.Inpod(o, rules.Loopback4, rules.Probe4), "iptables-legacy-restore", "--noflush")
	sh(t, ns, rules.Inpod(o, rules.Loopback6, rules.Probe6), "ip6tables-legacy-restore", "--noflush")
	got, err := mgr.InspectPod(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Equivalent || !slices.Equal(got.Backends(), []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat}) || !got.Options.Equal(o) {
		t.Errorf("equivalent %t, backends %v, options %s, reasons %q", got.Equivalent, got.Backends(), got.Options, got.Reasons)
	}
	if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
		t.Fatal(err)
	}
	noIstio(t, ns)
	if after := snapshot(t, ns); after != before {
		t.Errorf("after Remove the pod's other state differs:\n got: %s\nwant: %s", after, before)
	}
}

func TestNativeNftables(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	for name, o := range optionSets {
		t.Run(name, func(t *testing.T) {
			p := n.AddBarePod("nft-"+name, "default", "uid-nft-"+name)
			ns := p.NetnsPath()
			unrelated(t, ns)
			before := snapshot(t, ns)
			sh(t, ns, istiocni.RenderNft(o, true), "nft", "-f", "-")
			applyReturnPath(t, ns)
			got, err := mgr.InspectPod(ctx, ns)
			if err != nil {
				t.Fatal(err)
			}
			if !got.Equivalent || !slices.Equal(got.Backends(), []istiocni.Backend{istiocni.Nftables}) || got.Nft == nil || !got.Options.Equal(o) {
				t.Fatalf("equivalent %t backends %v options %s (want %s), reasons %q", got.Equivalent, got.Backends(), got.Options, o, got.Reasons)
			}
			want := []string{istiocni.NftNatTable, istiocni.NftMangleTable}
			if o.DNSCapture {
				want = append(want, istiocni.NftRawTable)
			}
			if !slices.Equal(got.Nft.Tables, want) || !got.Nft.IPv6 || !got.Nft.Exact {
				t.Errorf("nft state %+v, want tables %v with ip6 rules, exact", got.Nft, want)
			}
			if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
				t.Fatal(err)
			}
			noIstio(t, ns)
			if after := snapshot(t, ns); after != before {
				t.Errorf("after Remove the pod's other state differs:\n got: %s\nwant: %s", after, before)
			}
			if err := mgr.RemovePod(ctx, ns, istiocni.RemoveOptions{}); err != nil {
				t.Errorf("a second Remove: %v", err)
			}
		})
	}
	t.Run("hand-edited", func(t *testing.T) {
		p := n.AddBarePod("nft-edited", "default", "uid-nft-edited")
		sh(t, p.NetnsPath(), istiocni.RenderNft(podopts.Options{}, true)+"add rule inet istio-ambient-nat istio-output ip daddr 198.18.9.9 return\n", "nft", "-f", "-")
		applyReturnPath(t, p.NetnsPath())
		got, err := mgr.InspectPod(ctx, p.NetnsPath())
		if err != nil {
			t.Fatal(err)
		}
		if got.Equivalent || got.Nft == nil || got.Nft.Exact {
			t.Errorf("a hand-edited nft table is reported equivalent: %+v", got.Nft)
		}
	})
}

func TestNode(t *testing.T) {
	ctx := context.Background()
	mgr := istiocni.New()
	n := simnode.New(t)
	node := simnode.NetnsPath(n.NodeNS)
	unrelated(t, node)
	before := netfilterSnapshot(t, node)
	if got, err := mgr.InspectNode(ctx, node); err != nil || got.Found() {
		t.Fatalf("before istio-cni: %+v, %v", got, err)
	}
	var ref reference.Iptables
	ref.Setup(t, n)
	p := n.AddPod("probed")
	ref.Enroll(t, p, podopts.Options{})

	got, err := mgr.InspectNode(ctx, node)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Iptables) != 2 {
		t.Fatalf("host rules %+v, want ipv4 and ipv6", got.Iptables)
	}
	for _, r := range got.Iptables {
		// The reference applies with the machine's default iptables.
		if !r.Exact || len(r.Jumps) != 1 || r.Jumps[0] != "nat: -A POSTROUTING -j ISTIO_POSTRT" {
			t.Errorf("%s %s: exact %t (%s), jumps %q", r.Backend, r.Family, r.Exact, r.Diff, r.Jumps)
		}
	}
	if got.IPSets[istiocni.ProbeSetV4] != 1 || got.IPSets[istiocni.ProbeSetV6] != 1 || got.Entries() != 2 || got.NftTable {
		t.Errorf("ipsets %v (entries %d), nft table %t; want one entry in each ipset", got.IPSets, got.Entries(), got.NftTable)
	}
	// Another pod's UID leaves the entries alone.
	if err := mgr.RemoveProbeEntries(ctx, node, "someone-else", p.IPs()); err != nil {
		t.Fatal(err)
	}
	if got, _ := mgr.InspectNode(ctx, node); got.Entries() != 2 {
		t.Errorf("entries after removing another pod's: %d", got.Entries())
	}
	if err := mgr.RemoveProbeEntries(ctx, node, p.UID, p.IPs()); err != nil {
		t.Fatal(err)
	}
	if got, _ := mgr.InspectNode(ctx, node); got.Entries() != 0 || len(got.IPSets) != 2 {
		t.Errorf("after removing the pod's entries: %v", got.IPSets)
	}
	if err := mgr.RemoveNode(ctx, node); err != nil {
		t.Fatal(err)
	}
	noIstio(t, node)
	if out := sh(t, node, "", "ipset", "list", "-n"); strings.Contains(out, "istio") {
		t.Errorf("ipsets after RemoveNode: %s", out)
	}
	if after := netfilterSnapshot(t, node); after != before {
		t.Errorf("after RemoveNode the node's other state differs:\n got: %s\nwant: %s", after, before)
	}
	if err := mgr.RemoveNode(ctx, node); err != nil {
		t.Errorf("a second RemoveNode: %v", err)
	}
	if got, err := mgr.InspectNode(ctx, node); err != nil || got.Found() {
		t.Errorf("after RemoveNode: %+v, %v", got, err)
	}
}

func TestMissingNetns(t *testing.T) {
	mgr := istiocni.New()
	const path = "/run/netns/ht-no-such-netns"
	_, err := mgr.InspectPod(context.Background(), path)
	if err == nil || !strings.Contains(err.Error(), path) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("InspectPod of a missing netns: %v", err)
	}
	err = mgr.RemovePod(context.Background(), path, istiocni.RemoveOptions{})
	if err == nil || !strings.Contains(err.Error(), path) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RemovePod of a missing netns: %v", err)
	}
	if _, err := mgr.InspectNode(context.Background(), path); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("InspectNode of a missing netns: %v", err)
	}
}
