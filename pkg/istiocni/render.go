// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"fmt"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// Family is an IP family: its iptables tool prefix and the addresses
// istio-cni's rules name.
type Family struct {
	Name     string // "ipv4", "ipv6"
	tool     string // "iptables", "ip6tables"
	loopback string
	probe    string
}

// The families, with istio-cni's default host-probe SNAT addresses.
var (
	IPv4 = Family{Name: "ipv4", tool: "iptables", loopback: "127.0.0.1/32", probe: "169.254.7.127"}
	IPv6 = Family{Name: "ipv6", tool: "ip6tables", loopback: "::1/128", probe: "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"}
)

// istio-cni's iptables chains, in the pod and on the node.
const (
	ChainPrerouting      = "ISTIO_PRERT"
	ChainOutput          = "ISTIO_OUTPUT"
	ChainHostPostrouting = "ISTIO_POSTRT"
)

// Its probe ipsets on the node (hash:ip, the pod UID as comment).
const (
	ProbeSetV4 = "istio-inpod-probes-v4"
	ProbeSetV6 = "istio-inpod-probes-v6"
)

// RenderInpod renders the in-pod rules istio-cni's iptables mode writes
// for a family, as iptables-restore --noflush input: mangle and nat
// always, raw with DNS capture; each table's two chains jumped to from
// PREROUTING and OUTPUT.
func RenderInpod(o podopts.Options, f Family) string {
	mangle := []string{
		"-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
		"-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
	}
	var nat, raw []string
	for _, v := range o.RerouteInterfaces {
		nat = append(nat, "-A ISTIO_PRERT -i "+v+" -p tcp -j REDIRECT --to-ports 15001", "-A ISTIO_PRERT -i "+v+" -p tcp -j RETURN")
	}
	if !o.BypassInbound {
		nat = append(nat, "-A ISTIO_PRERT -s "+f.probe+" -p tcp -m tcp -j ACCEPT")
	}
	nat = append(nat, "-A ISTIO_OUTPUT -d "+f.probe+" -p tcp -m tcp -j ACCEPT")
	if !o.BypassInbound {
		nat = append(nat, "-A ISTIO_PRERT ! -d "+f.loopback+" -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006")
	}
	if o.DNSCapture {
		nat = append(nat,
			"-A ISTIO_OUTPUT ! -o lo -p udp -m mark ! --mark 0x539/0xfff -m udp --dport 53 -j REDIRECT --to-port 15053",
			"-A ISTIO_OUTPUT ! -d "+f.loopback+" -p tcp --dport 53 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15053")
		raw = append(raw,
			"-A ISTIO_OUTPUT -p udp -m mark --mark 0x539/0xfff -m udp --dport 53 -j CT --zone 1",
			"-A ISTIO_PRERT -p udp -m mark ! --mark 0x539/0xfff -m udp --sport 53 -j CT --zone 1")
	}
	nat = append(nat,
		"-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT",
		"-A ISTIO_OUTPUT ! -d "+f.loopback+" -o lo -j ACCEPT",
		"-A ISTIO_OUTPUT ! -d "+f.loopback+" -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001")
	var b strings.Builder
	table := func(name string, rules []string) {
		b.WriteString("*" + name + "\n:" + ChainPrerouting + " - [0:0]\n:" + ChainOutput + " - [0:0]\n")
		b.WriteString("-A PREROUTING -j " + ChainPrerouting + "\n-A OUTPUT -j " + ChainOutput + "\n")
		b.WriteString(strings.Join(rules, "\n") + "\nCOMMIT\n")
	}
	table("mangle", mangle)
	table("nat", nat)
	if len(raw) > 0 {
		table("raw", raw)
	}
	return b.String()
}

// RenderHost renders istio-cni's host-probe rule for a family as
// iptables-restore --noflush input: the ISTIO_POSTRT chain in nat,
// jumped to from the top of POSTROUTING.
func RenderHost(f Family) string {
	set := ProbeSetV4
	if f.Name == IPv6.Name {
		set = ProbeSetV6
	}
	return "*nat\n:" + ChainHostPostrouting + " - [0:0]\n-I POSTROUTING 1 -j " + ChainHostPostrouting + "\n" +
		"-A " + ChainHostPostrouting + " -m owner --socket-exists -p tcp -m set --match-set " + set +
		" dst -j SNAT --to-source " + f.probe + "\nCOMMIT\n"
}

// istio-cni's native nftables mode (Istio 1.28+): three inet tables, each
// with base chains prerouting and output hooked at the priority of the
// iptables table it replaces, and regular chains istio-prerouting and
// istio-output they jump to. The raw table exists with DNS capture only.
// On the node the nat table holds a postrouting chain (SNAT priority) and
// the probe sets istio-inpod-probes-v4/v6.
const (
	NftNatTable    = "istio-ambient-nat"
	NftMangleTable = "istio-ambient-mangle"
	NftRawTable    = "istio-ambient-raw"
)

// RenderNft renders, as `nft -f` input, the in-pod tables istio-cni's
// nftables mode creates for the options; v6 adds the ip6 rules it adds
// when IPv6 is enabled. Rules are in istio-cni's order.
func RenderNft(o podopts.Options, v6 bool) string {
	type rule struct{ table, chain, expr string }
	var rs []rule
	add := func(table, chain, expr string) { rs = append(rs, rule{table, chain, expr}) }
	add6 := func(table, chain, expr string) {
		if v6 {
			add(table, chain, expr)
		}
	}
	const nat, mangle, raw = NftNatTable, NftMangleTable, NftRawTable
	p4, p6 := IPv4.probe, IPv6.probe
	add(mangle, "prerouting", "jump istio-prerouting")
	add(mangle, "output", "jump istio-output")
	add(nat, "output", "jump istio-output")
	if o.DNSCapture {
		add(raw, "prerouting", "jump istio-prerouting")
		add(raw, "output", "jump istio-output")
	}
	add(nat, "prerouting", "jump istio-prerouting")
	for _, v := range o.RerouteInterfaces {
		add(nat, "istio-prerouting", "iifname "+v+" meta l4proto tcp counter redirect to :15001")
		add(nat, "istio-prerouting", "iifname "+v+" meta l4proto tcp counter return")
	}
	add(mangle, "istio-prerouting", "meta mark & 0xfff == 0x539 counter ct mark set ct mark & 0xfffff000 | 0x111")
	if !o.BypassInbound {
		add(nat, "istio-prerouting", "meta l4proto tcp ip saddr "+p4+" counter accept")
		add6(nat, "istio-prerouting", "meta l4proto tcp ip6 saddr "+p6+" counter accept")
	}
	add(nat, "istio-output", "meta l4proto tcp ip daddr "+p4+" counter accept")
	add6(nat, "istio-output", "meta l4proto tcp ip6 daddr "+p6+" counter accept")
	if !o.BypassInbound {
		add(nat, "istio-prerouting", "ip daddr != 127.0.0.1/32 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006")
		add6(nat, "istio-prerouting", "ip6 daddr != ::1/128 tcp dport != 15008 mark and 0xfff != 0x539 counter redirect to :15006")
	}
	add(mangle, "istio-output", "ct mark and 0xfff == 0x111 counter meta mark set ct mark")
	if o.DNSCapture {
		add(nat, "istio-output", "oifname != lo mark and 0xfff != 0x539 udp dport 53 counter redirect to :15053")
		add(nat, "istio-output", "ip daddr != 127.0.0.1/32 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053")
		add6(nat, "istio-output", "ip6 daddr != ::1/128 tcp dport 53 mark and 0xfff != 0x539 counter redirect to :15053")
		add(raw, "istio-output", "udp dport 53 meta mark and 0xfff == 0x539 counter ct zone set 1")
		add(raw, "istio-prerouting", "udp sport 53 meta mark and 0xfff != 0x539 counter ct zone set 1")
	}
	add(nat, "istio-output", "meta l4proto tcp mark and 0xfff == 0x111 counter accept")
	add(nat, "istio-output", "oifname lo ip daddr != 127.0.0.1/32 counter accept")
	add6(nat, "istio-output", "oifname lo ip6 daddr != ::1/128 counter accept")
	add(nat, "istio-output", "meta l4proto tcp ip daddr != 127.0.0.1/32 mark and 0xfff != 0x539 counter redirect to :15001")
	add6(nat, "istio-output", "meta l4proto tcp ip6 daddr != ::1/128 mark and 0xfff != 0x539 counter redirect to :15001")

	base := map[string][2]string{
		nat:    {"type nat hook prerouting priority -100", "type nat hook output priority -100"},
		mangle: {"type filter hook prerouting priority -150", "type route hook output priority -150"},
		raw:    {"type filter hook prerouting priority -300", "type filter hook output priority -300"},
	}
	var b strings.Builder
	for _, table := range []string{nat, mangle, raw} {
		if table == raw && !o.DNSCapture {
			continue
		}
		fmt.Fprintf(&b, "add table inet %s\nflush table inet %s\n", table, table)
		fmt.Fprintf(&b, "add chain inet %s prerouting { %s ; }\n", table, base[table][0])
		fmt.Fprintf(&b, "add chain inet %s output { %s ; }\n", table, base[table][1])
		fmt.Fprintf(&b, "add chain inet %s istio-prerouting\nadd chain inet %s istio-output\n", table, table)
		for _, r := range rs {
			if r.table == table {
				fmt.Fprintf(&b, "add rule inet %s %s %s\n", table, r.chain, r.expr)
			}
		}
	}
	return b.String()
}
