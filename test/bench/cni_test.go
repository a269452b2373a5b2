// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The real istio-cni's check in the timed window holds only once the
// pod's netns has istio-cni's nat chain in both families: not in a fresh
// netns, not with IPv4's alone.
func TestInpodCheckWantsTheChainInBothFamilies(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("inpod")
	chk := inpodCheck{pods: []cniPod{{Name: p.Name, Netns: p.NetnsPath()}}}
	const rules = "*nat\n:" + inpodChain + " - [0:0]\n-A OUTPUT -j " + inpodChain + "\nCOMMIT\n"
	for _, step := range []struct {
		restore string // run before the check, "" none
		want    bool
	}{
		{"", false},
		{"iptables-nft-restore", false},
		{"ip6tables-nft-restore", true},
	} {
		if step.restore != "" {
			reference.Run(t, p.NetnsPath(), rules, step.restore)
		}
		got, err := chk.holds("ADD", 0)
		if err != nil || got != step.want {
			t.Fatalf("after %q: holds %t (%v), want %t", step.restore, got, err, step.want)
		}
	}
	if ok, err := chk.holds("VERSION", 0); !ok || err != nil {
		t.Fatalf("VERSION: holds %t (%v), want true: nothing to check", ok, err)
	}
}
