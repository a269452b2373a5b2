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

	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Opts are the per-pod modes (R12-R14).
type Opts = rules.Opts

// Iptables applies istio-cni's documented rules (contract sections
// 2 and 3): in-pod rules in each pod netns, and the host-probe SNAT rule
// with its ipsets in the node netns. It is the reference the eBPF path
// must match.
type Iptables struct {
	node   *simnode.Node
	ipsets map[string]string // family -> ipset name
}

// The host rule: local sockets (kubelet) to enrolled pods leave with the
// probe address.
// Setup installs the node-level rule and ipsets.
func (b *Iptables) Setup(t testing.TB, n *simnode.Node) {
	b.node = n
	b.ipsets = map[string]string{"inet": rules.IpsetV4, "inet6": rules.IpsetV6}
	node := simnode.NetnsPath(n.NodeNS)
	for fam, set := range b.ipsets {
		run(t, node, "", "ipset", "create", set, "hash:ip", "family", fam, "comment")
	}
	run(t, node, "", "iptables", "-t", "nat", "-A", "POSTROUTING", "-m", "owner", "--socket-exists", "-p", "tcp",
		"-m", "set", "--match-set", b.ipsets["inet"], "dst", "-j", "SNAT", "--to-source", rules.Probe4)
	run(t, node, "", "ip6tables", "-t", "nat", "-A", "POSTROUTING", "-m", "owner", "--socket-exists", "-p", "tcp",
		"-m", "set", "--match-set", b.ipsets["inet6"], "dst", "-j", "SNAT", "--to-source", rules.Probe6)
}

func run(t testing.TB, netnsPath, stdin string, args ...string) string {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + netnsPath}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), netnsPath, err, out)
	}
	return string(out)
}

// Enroll applies the in-pod rules and adds the pod to the ipsets.
func (b *Iptables) Enroll(t testing.TB, p *simnode.Pod, o Opts) {
	t.Helper()
	ns := p.NetnsPath()
	run(t, ns, rules.Inpod(o, rules.Loopback4, rules.Probe4), "iptables-restore", "--noflush")
	run(t, ns, rules.Inpod(o, rules.Loopback6, rules.Probe6), "ip6tables-restore", "--noflush")
	for _, fam := range []string{"-4", "-6"} {
		run(t, ns, "", "ip", fam, "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
	}
	run(t, ns, "", "ip", "-4", "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	run(t, ns, "", "ip", "-6", "route", "add", "local", "::/0", "dev", "lo", "table", "100")
	node := simnode.NetnsPath(b.node.NodeNS)
	run(t, node, "", "ipset", "add", "-exist", b.ipsets["inet"], p.V4.String(), "comment", p.UID)
	run(t, node, "", "ipset", "add", "-exist", b.ipsets["inet6"], p.V6.String(), "comment", p.UID)
}

// Remove flushes the pod's rules and takes its IPs out of the ipsets.
func (b *Iptables) Remove(t testing.TB, p *simnode.Pod) {
	t.Helper()
	ns := p.NetnsPath()
	for _, tool := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"mangle", "nat", "raw"} {
			run(t, ns, "", tool, "-t", table, "-F")
			run(t, ns, "", tool, "-t", table, "-X")
		}
	}
	for _, fam := range []string{"-4", "-6"} {
		run(t, ns, "", "ip", fam, "rule", "del", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
		run(t, ns, "", "ip", fam, "route", "flush", "table", "100")
	}
	// H4: an IP is removed only while its entry still names this pod.
	node := simnode.NetnsPath(b.node.NodeNS)
	for fam, ip := range map[string]string{"inet": p.V4.String(), "inet6": p.V6.String()} {
		list := run(t, node, "", "ipset", "list", b.ipsets[fam])
		if strings.Contains(list, ip+" comment \""+p.UID+"\"") {
			run(t, node, "", "ipset", "del", b.ipsets[fam], ip)
		}
	}
}
