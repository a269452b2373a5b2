// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package rules renders istio-cni's in-pod iptables rules and names the
// node's ipsets. It imports nothing of the test harness, so the reference
// CNI plugin (test/reference/iptables-cni) stays as small as a plugin is.
package rules

import "strings"

// Opts are the per-pod modes (R12-R14).
type Opts struct {
	DNS         bool     // R9/R13: DNS capture
	IngressMode bool     // R12: ambient.istio.io/bypass-inbound-capture
	Reroute     []string // R14: istio.io/reroute-virtual-interfaces
}

// The node's ipsets of enrolled pod IPs (istio-cni names them
// istio-inpod-probes-v4 and -v6), hash:ip with the pod UID as comment.
const (
	IpsetV4 = "ae-pods-v4"
	IpsetV6 = "ae-pods-v6"
)

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
func Inpod(o Opts, loopback, probe string) string {
	mangle := []string{
		"-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
		"-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff",
	}
	var nat, raw []string
	for _, v := range o.Reroute {
		nat = append(nat, "-A ISTIO_PRERT -i "+v+" -p tcp -j REDIRECT --to-ports 15001", "-A ISTIO_PRERT -i "+v+" -p tcp -j RETURN")
	}
	if !o.IngressMode {
		nat = append(nat, "-A ISTIO_PRERT -s PROBE -p tcp -m tcp -j ACCEPT")
	}
	nat = append(nat, "-A ISTIO_OUTPUT -d PROBE -p tcp -m tcp -j ACCEPT")
	if !o.IngressMode {
		nat = append(nat, "-A ISTIO_PRERT ! -d LOOPBACK -p tcp ! --dport 15008 -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15006")
	}
	if o.DNS {
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
		return "*" + name + "\n:ISTIO_PRERT - [0:0]\n:ISTIO_OUTPUT - [0:0]\n-A PREROUTING -j ISTIO_PRERT\n-A OUTPUT -j ISTIO_OUTPUT\n" +
			strings.Join(rules, "\n") + "\nCOMMIT\n"
	}
	out := table("mangle", mangle) + table("nat", nat)
	if len(raw) > 0 {
		out += table("raw", raw)
	}
	return strings.NewReplacer("LOOPBACK", loopback, "PROBE", probe).Replace(out)
}
