// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package rules renders istio-cni's in-pod iptables rules and names the
// node's ipsets. It imports nothing of the test harness, so the reference
// CNI plugin (test/reference/iptables-cni) stays as small as a plugin is.
package rules

import (
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// The node's ipsets of enrolled pod IPs, named as istio-cni names them,
// hash:ip with the pod UID as comment.
const (
	IpsetV4 = "istio-inpod-probes-v4"
	IpsetV6 = "istio-inpod-probes-v6"
)

// istio-cni's chains: in the pod (mangle, nat, and raw with DNS capture),
// and on the node (nat).
const (
	ChainPrerouting      = "ISTIO_PRERT"
	ChainOutput          = "ISTIO_OUTPUT"
	ChainHostPostrouting = "ISTIO_POSTRT"
)

// Host renders istio-cni's host-probe rule for one family, as
// iptables-restore --noflush input: its own nat chain, jumped to from the
// first position of POSTROUTING, where local sockets (kubelet) to enrolled
// pods leave with the probe address. The jump is left out (withJump
// false) where it exists already: iptables-restore would add a second.
func Host(ipset, probe string, withJump bool) string {
	out := "*nat\n:" + ChainHostPostrouting + " - [0:0]\n"
	if withJump {
		out += "-I POSTROUTING 1 -j " + ChainHostPostrouting + "\n"
	}
	return out + "-A " + ChainHostPostrouting + " -m owner --socket-exists -p tcp -m set --match-set " + ipset +
		" dst -j SNAT --to-source " + probe + "\nCOMMIT\n"
}

// InpodCleanup is what istio-cni runs to take its rules out of a pod, per
// family: the jumps into its chains, then the chains, flushed and deleted.
// Any of them may fail (a table it did not use, rules already gone), and
// istio-cni ignores that; nothing else in the pod is touched.
func InpodCleanup() [][]string {
	var cmds [][]string
	for _, j := range []struct{ table, from, to string }{
		{"mangle", "PREROUTING", ChainPrerouting}, {"mangle", "OUTPUT", ChainOutput},
		{"nat", "OUTPUT", ChainOutput}, {"raw", "PREROUTING", ChainPrerouting},
		{"raw", "OUTPUT", ChainOutput}, {"nat", "PREROUTING", ChainPrerouting},
	} {
		cmds = append(cmds, []string{"-t", j.table, "-D", j.from, "-j", j.to})
	}
	for _, op := range []string{"-F", "-X"} {
		for _, table := range []string{"mangle", "nat", "raw"} {
			for _, chain := range []string{ChainPrerouting, ChainOutput} {
				cmds = append(cmds, []string{"-t", table, op, chain})
			}
		}
	}
	return cmds
}

// HostCleanup takes istio-cni's host rule out of the node, per family.
func HostCleanup() [][]string {
	return [][]string{
		{"-t", "nat", "-D", "POSTROUTING", "-j", ChainHostPostrouting},
		{"-t", "nat", "-F", ChainHostPostrouting},
		{"-t", "nat", "-X", ChainHostPostrouting},
	}
}

// Per family: the loopback network and the host-probe SNAT address as the
// rules write them.
const (
	Loopback4 = "127.0.0.1/32"
	Loopback6 = "::1/128"
	Probe4    = "169.254.7.127"
	Probe6    = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
)

// Inpod renders istio-cni's in-pod rules for one family, as
// iptables-restore input: inbound by nat REDIRECT (ztunnel reads
// SO_ORIGINAL_DST), the original-source return path by connmark, DNS with
// its own conntrack zone.
func Inpod(o podopts.Options, loopback, probe string) string {
	mangle := []string{
		"-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
		"-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
	}
	var nat, raw []string
	for _, v := range o.RerouteInterfaces {
		nat = append(nat, "-A ISTIO_PRERT -i "+v+" -p tcp -j REDIRECT --to-ports 15001", "-A ISTIO_PRERT -i "+v+" -p tcp -j RETURN")
	}
	if !o.BypassInbound {
		nat = append(nat, "-A ISTIO_PRERT -s PROBE -p tcp -m tcp -j ACCEPT")
	}
	nat = append(nat, "-A ISTIO_OUTPUT -d PROBE -p tcp -m tcp -j ACCEPT")
	if !o.BypassInbound {
		nat = append(nat, "-A ISTIO_PRERT ! -d LOOPBACK -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006")
	}
	if o.DNSCapture {
		nat = append(nat,
			"-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053",
			"-A ISTIO_OUTPUT ! -d LOOPBACK -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053")
		raw = append(raw,
			"-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
			"-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1")
	}
	nat = append(nat,
		"-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
		"-A ISTIO_OUTPUT ! -d LOOPBACK -o lo -j ACCEPT",
		"-A ISTIO_OUTPUT ! -d LOOPBACK -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001")
	table := func(name string, rules []string) string {
		return "*" + name + "\n:" + ChainPrerouting + " - [0:0]\n:" + ChainOutput + " - [0:0]\n-A PREROUTING -j " + ChainPrerouting + "\n-A OUTPUT -j " + ChainOutput + "\n" +
			strings.Join(rules, "\n") + "\nCOMMIT\n"
	}
	out := table("mangle", mangle) + table("nat", nat)
	if len(raw) > 0 {
		out += table("raw", raw)
	}
	return strings.NewReplacer("LOOPBACK", loopback, "PROBE", probe).Replace(out)
}
