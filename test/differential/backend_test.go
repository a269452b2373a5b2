//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
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
