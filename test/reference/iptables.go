// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package reference applies istio-cni's documented iptables rules to
// simulated pods: the baseline the conformance suite and the benchmarks
// hold the eBPF data path against. Test-only; nothing ships it.
package reference

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Iptables applies istio-cni's documented rules (contract sections
// 2 and 3): in-pod rules in each pod netns, and the host-probe SNAT rule
// with its ipsets in the node netns. It is the reference the eBPF path
// must match.
type Iptables struct {
	// Backend is the iptables the rules are written with: Legacy or
	// NftCompat, or the default (empty): the installed iptables.
	Backend Backend

	node   *simnode.Node
	ipsets map[string]string // family -> ipset name
}

// Backend names an iptables backend.
type Backend string

// The iptables backends.
const (
	Legacy    Backend = "iptables-legacy"
	NftCompat Backend = "iptables-nft"
)

// tool is the name of one of iptables' binaries (iptables, ip6tables,
// iptables-restore, ...) in the backend.
func (b *Iptables) tool(name string) string {
	if b.Backend == "" {
		return name
	}
	family, rest, _ := strings.Cut(name, "-")
	suffix := strings.TrimPrefix(string(b.Backend), "iptables")
	if rest == "" {
		return family + suffix
	}
	return family + suffix + "-" + rest
}

// WithBackend is the same reference (the same node and ipsets) writing
// with another backend: for pods whose rules another iptables wrote.
func (b *Iptables) WithBackend(backend Backend) *Iptables {
	c := *b
	c.Backend = backend
	return &c
}

// Setup installs the node-level rule and ipsets as istio-cni does: the
// ipsets, then its ISTIO_POSTRT chain with the jump at the top of
// POSTROUTING.
func (b *Iptables) Setup(t testing.TB, n *simnode.Node) {
	b.node = n
	b.ipsets = map[string]string{"inet": rules.IpsetV4, "inet6": rules.IpsetV6}
	node := simnode.NetnsPath(n.NodeNS)
	for fam, set := range b.ipsets {
		Run(t, node, "", "ipset", "create", set, "hash:ip", "family", fam, "comment")
	}
	Run(t, node, rules.Host(rules.IpsetV4, rules.Probe4, true), b.tool("iptables-restore"), "--noflush")
	Run(t, node, rules.Host(rules.IpsetV6, rules.Probe6, true), b.tool("ip6tables-restore"), "--noflush")
}

// Run runs a command in the netns at netnsPath (by nsenter, so /sys and
// bpffs stay as they are) with stdin, and returns its combined output,
// failing the test on error.
func Run(t testing.TB, netnsPath, stdin string, args ...string) string {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + netnsPath}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), netnsPath, err, out)
	}
	return string(out)
}

// tryRun runs a command whose failure istio-cni ignores too (a chain it
// did not create in that table).
func tryRun(netnsPath string, args ...string) {
	_ = exec.Command("nsenter", append([]string{"--net=" + netnsPath}, args...)...).Run()
}

// Enroll applies the in-pod rules and adds the pod to the ipsets.
func (b *Iptables) Enroll(t testing.TB, p *simnode.Pod, o podopts.Options) {
	t.Helper()
	ns := p.NetnsPath()
	// Applied again (istio-cni's reconcile), the old rules go first, so
	// no jump is doubled.
	if strings.Contains(Run(t, ns, "", b.tool("iptables-save"), "-t", "nat"), ":"+rules.ChainPrerouting+" ") {
		for _, tool := range []string{b.tool("iptables"), b.tool("ip6tables")} {
			for _, args := range rules.InpodCleanup() {
				tryRun(ns, append([]string{tool}, args...)...)
			}
		}
	}
	Run(t, ns, rules.Inpod(o, rules.Loopback4, rules.Probe4), b.tool("iptables-restore"), "--noflush")
	Run(t, ns, rules.Inpod(o, rules.Loopback6, rules.Probe6), b.tool("ip6tables-restore"), "--noflush")
	for _, fam := range []string{"-4", "-6"} {
		// Added once: istio-cni takes EEXIST as done.
		if !strings.Contains(Run(t, ns, "", "ip", fam, "rule", "show", "pref", "32764"), "lookup 100") {
			Run(t, ns, "", "ip", fam, "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
		}
	}
	Run(t, ns, "", "ip", "-4", "route", "replace", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	Run(t, ns, "", "ip", "-6", "route", "replace", "local", "::/0", "dev", "lo", "table", "100")
	node := simnode.NetnsPath(b.node.NodeNS)
	Run(t, node, "", "ipset", "add", "-exist", b.ipsets["inet"], p.V4.String(), "comment", p.UID)
	Run(t, node, "", "ipset", "add", "-exist", b.ipsets["inet6"], p.V6.String(), "comment", p.UID)
}

// Remove takes out what istio-cni put in the pod, and only that: the jumps
// into its chains and the chains (other rules in the pod stay), its policy
// rule and its two local routes; and the pod's IPs from the ipsets.
func (b *Iptables) Remove(t testing.TB, p *simnode.Pod) {
	t.Helper()
	ns := p.NetnsPath()
	for _, tool := range []string{b.tool("iptables"), b.tool("ip6tables")} {
		for _, args := range rules.InpodCleanup() {
			tryRun(ns, append([]string{tool}, args...)...)
		}
	}
	for _, fam := range []string{"-4", "-6"} {
		Run(t, ns, "", "ip", fam, "rule", "del", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
	}
	Run(t, ns, "", "ip", "-4", "route", "del", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	Run(t, ns, "", "ip", "-6", "route", "del", "local", "::/0", "dev", "lo", "table", "100")
	// H4: an IP is removed only while its entry still names this pod.
	node := simnode.NetnsPath(b.node.NodeNS)
	for fam, ip := range map[string]string{"inet": p.V4.String(), "inet6": p.V6.String()} {
		list := Run(t, node, "", "ipset", "list", b.ipsets[fam])
		if strings.Contains(list, ip+" comment \""+p.UID+"\"") {
			Run(t, node, "", "ipset", "del", b.ipsets[fam], ip)
		}
	}
}
