// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// backend puts pods in and out of the mesh on one simulated node.
type backend interface {
	name() string
	setup(t *testing.T, n *simnode.Node)
	enroll(t *testing.T, p *simnode.Pod)
	remove(t *testing.T, p *simnode.Pod)
}

func backends() []backend { return []backend{&ebpfBackend{}, &iptablesBackend{}} }

// ebpfBackend is ambient-ebpf's data path.
type ebpfBackend struct{ dp *dataplane.Dataplane }

func (b *ebpfBackend) name() string { return "ebpf" }

func (b *ebpfBackend) setup(t *testing.T, n *simnode.Node) {
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatalf("load dataplane: %v", err)
	}
	b.dp = dp
	t.Cleanup(func() {
		if err := dp.Uninstall(); err != nil {
			t.Errorf("uninstall dataplane: %v", err)
		}
	})
}

func (b *ebpfBackend) enroll(t *testing.T, p *simnode.Pod) {
	t.Helper()
	err := b.dp.Enroll(context.Background(), dataplane.Pod{
		UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs(),
	})
	if err != nil {
		t.Fatalf("enroll %s: %v", p.Name, err)
	}
}

func (b *ebpfBackend) remove(t *testing.T, p *simnode.Pod) {
	t.Helper()
	if err := b.dp.Remove(context.Background(), p.UID); err != nil {
		t.Fatalf("remove %s: %v", p.Name, err)
	}
}

// iptablesBackend applies istio-cni's documented in-pod rules (contract
// section 2) in the pod netns: the reference the eBPF path must match.
type iptablesBackend struct{}

func (iptablesBackend) name() string { return "iptables" }

func (iptablesBackend) setup(*testing.T, *simnode.Node) {}

// inpodRules renders the in-pod rules for one family.
func inpodRules(loopback, probe string) string {
	return strings.NewReplacer("LOOPBACK", loopback, "PROBE", probe).Replace(`*mangle
:ISTIO_PRERT - [0:0]
:ISTIO_OUTPUT - [0:0]
-A PREROUTING -j ISTIO_PRERT
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff
-A ISTIO_PRERT -s PROBE -p tcp -m tcp -j ACCEPT
-A ISTIO_PRERT ! -d LOOPBACK -p tcp -i lo -j ACCEPT
-A ISTIO_PRERT -p tcp -m tcp --dport 15008 -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15008 --tproxy-mark 0x111/0xfff
-A ISTIO_PRERT -p tcp -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
-A ISTIO_PRERT ! -d LOOPBACK -p tcp -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15006 --tproxy-mark 0x111/0xfff
-A ISTIO_OUTPUT -m connmark --mark 0x111/0xfff -j CONNMARK --restore-mark --nfmask 0xffffffff --ctmask 0xffffffff
COMMIT
*nat
:ISTIO_OUTPUT - [0:0]
-A OUTPUT -j ISTIO_OUTPUT
-A ISTIO_OUTPUT -d PROBE -p tcp -m tcp -j ACCEPT
-A ISTIO_OUTPUT -p tcp -m mark --mark 0x111/0xfff -j ACCEPT
-A ISTIO_OUTPUT ! -d LOOPBACK -o lo -j ACCEPT
-A ISTIO_OUTPUT ! -d LOOPBACK -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001
COMMIT
`)
}

func nsenter(t *testing.T, p *simnode.Pod, stdin string, args ...string) {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + p.NetnsPath()}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s in %s: %v: %s", strings.Join(args, " "), p.Name, err, out)
	}
}

func (iptablesBackend) enroll(t *testing.T, p *simnode.Pod) {
	t.Helper()
	nsenter(t, p, inpodRules("127.0.0.1/32", "169.254.7.127"), "iptables-restore", "--noflush")
	nsenter(t, p, inpodRules("::1/128", "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"), "ip6tables-restore", "--noflush")
	for _, fam := range []string{"-4", "-6"} {
		nsenter(t, p, "", "ip", fam, "rule", "add", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
	}
	nsenter(t, p, "", "ip", "-4", "route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", "100")
	nsenter(t, p, "", "ip", "-6", "route", "add", "local", "::/0", "dev", "lo", "table", "100")
}

func (iptablesBackend) remove(t *testing.T, p *simnode.Pod) {
	t.Helper()
	for _, tool := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"mangle", "nat"} {
			nsenter(t, p, "", tool, "-t", table, "-F")
			nsenter(t, p, "", tool, "-t", table, "-X")
		}
	}
	for _, fam := range []string{"-4", "-6"} {
		nsenter(t, p, "", "ip", fam, "rule", "del", "fwmark", "0x111/0xfff", "pref", "32764", "lookup", "100")
		nsenter(t, p, "", "ip", fam, "route", "flush", "table", "100")
	}
}

// rulesIn lists the iptables and nftables rules present in a netns.
func rulesIn(t *testing.T, netnsPath string) string {
	t.Helper()
	var found []string
	for _, tool := range [][]string{{"iptables-legacy-save"}, {"ip6tables-legacy-save"}, {"nft", "list", "ruleset"}} {
		if _, err := exec.LookPath(tool[0]); err != nil {
			if tool[0] == "nft" {
				// iptables-nft-save lists nftables tables created through iptables.
				tool = []string{"iptables-nft-save"}
			} else {
				continue
			}
		}
		out, err := exec.Command("nsenter", append([]string{"--net=" + netnsPath}, tool...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v: %s", tool[0], err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if strings.HasPrefix(line, "-A ") || strings.Contains(line, "chain ") || strings.HasPrefix(line, "table ") {
				found = append(found, fmt.Sprintf("%s: %s", tool[0], line))
			}
		}
	}
	return strings.Join(found, "\n")
}
