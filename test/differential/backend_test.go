//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"context"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// legacyNode gives a node what a kube-proxy in legacy iptables mode
// leaves in its netns: a nat chain of each family, in iptables-legacy.
func legacyNode(t *testing.T) func(*simnode.Node) {
	return func(n *simnode.Node) {
		for _, bin := range []string{"iptables-legacy", "ip6tables-legacy"} {
			reference.Run(t, simnode.NetnsPath(n.NodeNS), "", bin, "-t", "nat", "-N", "KUBE-SERVICES")
		}
	}
}

// A node whose netns already holds legacy iptables rules: istio-cni
// takes its backend from the node's rules and writes the pod's and the
// node's rules with iptables-legacy; they are test/reference's with that
// backend on a node with the same legacy chain. (ambient-ebpf writes no
// iptables rules on any node, so there is nothing of ours to compare.)
func TestOnePodRulesOnALegacyIptablesNode(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	nodeName := "diff-" + testenv.RunID()
	s := istioCNISide(t, c, nodeName, legacyNode(t))
	p, _ := addEnabledPod(t, c, s, nodeName)
	if backend := compareWithReference(t, s.node, p, legacyNode(t)); backend != reference.Legacy {
		t.Errorf("istio-cni wrote its rules with %s on a node with legacy rules, want %s", backend, reference.Legacy)
	}
}

// With native nftables istio-cni writes nftables tables of its own, no
// iptables rules. pkg/istiocni, which renders what istio-cni writes to
// tell a takeover what is exactly its state, finds them exact in the pod
// (with the chart's options: DNS capture on) and on the node (its probe
// table), as the takeover needs (test/reference has no native nftables
// rules; this is their comparison).
func TestOnePodRulesWithNativeNftables(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	nodeName := "diff-" + testenv.RunID()
	s := istioCNISideWith(t, c, istiocnireal.Options{NodeName: nodeName, Values: istiocnireal.NativeNftablesValues})
	p, _ := addEnabledPod(t, c, s, nodeName)
	ctx := context.Background()
	mgr := istiocni.New()
	got, err := mgr.InspectPod(ctx, p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	if got.Nft == nil || !got.Nft.Exact || !got.Equivalent || len(got.Iptables) != 0 || !got.Options.Equal(podopts.Options{DNSCapture: true}) {
		t.Errorf("the pod as pkg/istiocni reads it: nft %+v, iptables %+v, options %s, equivalent %t %q\nnft list ruleset:\n%s",
			got.Nft, got.Iptables, got.Options, got.Equivalent, got.Reasons, reference.Run(t, p.NetnsPath(), "", "nft", "list", "ruleset"))
	}
	node, err := mgr.InspectNode(ctx, simnode.NetnsPath(s.node.NodeNS))
	if err != nil {
		t.Fatal(err)
	}
	if !node.NftTable || len(node.Iptables) != 0 || node.Entries() != 2 {
		t.Errorf("the node as pkg/istiocni reads it: %+v\nnft list ruleset:\n%s", node, reference.Run(t, simnode.NetnsPath(s.node.NodeNS), "", "nft", "list", "ruleset"))
	}
}
