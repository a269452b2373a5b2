// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// backend puts pods in and out of the mesh on one simulated node.
type backend interface {
	name() string
	setup(t *testing.T, n *simnode.Node)
	enroll(t *testing.T, p *simnode.Pod, o podOpts)
	remove(t *testing.T, p *simnode.Pod)
}

// agentBackend is a backend whose node agent serves ztunnel over ZDS and
// hands it each pod it enrols: it starts the stand-in against its socket.
type agentBackend interface {
	startZtunnel(t *testing.T, n *simnode.Node) *simnode.Ztunnel
}

// ztunnelWatcher is a backend that needs to know where the stand-in runs
// (the per-pod socket hooks attach to its cgroup).
type ztunnelWatcher interface {
	ztunnelStarted(t *testing.T, n *simnode.Node)
}

// podOpts are the per-pod modes (R12-R14).
type podOpts struct {
	dns         bool     // R9/R13: DNS capture
	ingressMode bool     // R12: ambient.istio.io/bypass-inbound-capture
	reroute     []string // R14: istio.io/reroute-virtual-interfaces
}

// backends are the data paths every row runs on: ambient-ebpf's, again
// with the sockmap acceleration in both directions (on kernels without it,
// the flag's fallback) and with per-pod socket hooks, istio-cni's iptables rules, the reference, and,
// built with the istiocnireal tag, the real istio-cni (realBackends).
func backends() []backend {
	all := []backend{&ebpfBackend{}, &ebpfBackend{accel: accel.Both}}
	// Under emulation (hack/vmtest) the per-pod hooks' pass is left out:
	// the same programs as the ebpf backend's, on other cgroups, which
	// the guests attach per pod in TestSocketLoadBalancerRunsAfterOurs and
	// pkg/dataplane; CI's time has no room for a fourth emulated pass.
	if os.Getenv("AMBIENT_EBPF_GUEST") == "" {
		all = append(all, &ebpfBackend{hooks: dataplane.SocketHooksPods})
	}
	return append(append(all, &iptablesBackend{}), realBackends()...)
}

// referenceBackend is the backend the others must agree with: the real
// istio-cni where it runs (the istiocnireal tag), else the iptables rules
// that imitate it (on the kernels under qemu).
func referenceBackend() string {
	if real := realBackends(); len(real) > 0 {
		return real[0].name()
	}
	return "iptables"
}

// ebpfBackend is ambient-ebpf's data path.
type ebpfBackend struct {
	accel  accel.Mode
	probes bpfobj.ProbeMode      // "": SNAT, as istio-cni, which the rows compare with
	hooks  dataplane.SocketHooks // "": shared, at the node's cgroup root
	// split: the shared hooks on the pods' cgroup (as the agent's
	// --pods-cgroup=auto does on a node), the rest on the root.
	split bool
	dp    *dataplane.Dataplane
}

func (b *ebpfBackend) name() string {
	switch {
	case b.accel.On():
		return "ebpf-sockmap"
	case b.probes == bpfobj.ProbeDirect:
		return "ebpf-direct"
	case b.hooks == dataplane.SocketHooksPods:
		return "ebpf-pods"
	}
	return "ebpf"
}

func (b *ebpfBackend) setup(t *testing.T, n *simnode.Node) {
	cfg := ebpfConfig(n)
	cfg.SockmapAccel = b.accel
	if b.probes != "" {
		cfg.HostProbes = b.probes
	}
	if b.hooks == dataplane.SocketHooksPods || b.split {
		cfg.PodsCgroup, cfg.SocketHooks = n.PodsCgroup, b.hooks
	}
	dp, err := dataplane.New(cfg)
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

// ebpfConfig is the data path's configuration for a node. Host probes are
// SNATed, as istio-cni does, since the rows compare with its rules; the
// direct mode has rows of its own (probes_test.go).
func ebpfConfig(n *simnode.Node) dataplane.Config {
	return dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), HostProbes: bpfobj.ProbeSNAT}
}

func (b *ebpfBackend) ztunnelStarted(t *testing.T, n *simnode.Node) {
	t.Helper()
	if err := b.dp.AttachZtunnel(n.ZtunnelCgroup()); err != nil {
		t.Fatal(err)
	}
}

func (b *ebpfBackend) enroll(t *testing.T, p *simnode.Pod, o podOpts) {
	t.Helper()
	err := b.dp.Enroll(context.Background(), dataplane.Pod{
		UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs(),
		Options: podopts.Options{DNSCapture: o.dns, BypassInbound: o.ingressMode, RerouteInterfaces: o.reroute},
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

// iptablesBackend is istio-cni's rules, from package reference.
type iptablesBackend struct{ reference.Iptables }

func (*iptablesBackend) name() string { return "iptables" }

func (b *iptablesBackend) setup(t *testing.T, n *simnode.Node) { b.Setup(t, n) }

func (b *iptablesBackend) enroll(t *testing.T, p *simnode.Pod, o podOpts) {
	b.Enroll(t, p, podopts.Options{DNSCapture: o.dns, BypassInbound: o.ingressMode, RerouteInterfaces: o.reroute})
}

func (b *iptablesBackend) remove(t *testing.T, p *simnode.Pod) { b.Remove(t, p) }

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
