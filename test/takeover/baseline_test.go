// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// editOneRule hand-edits one of istio-cni's rules (IPv4 only): its nat
// probe exemption names another source. The pod stays redirected by
// iptables, but its rules are no longer istio-cni's exactly.
func editOneRule(backend reference.Backend) func(t *testing.T, p *simnode.Pod) {
	return func(t *testing.T, p *simnode.Pod) {
		t.Helper()
		reference.Run(t, p.NetnsPath(), "", string(backend), "-t", "nat", "-R", "ISTIO_PRERT", "1", "-s", "169.254.7.128/32", "-p", "tcp", "-m", "tcp", "-j", "ACCEPT")
	}
}

// The harness itself, without the agent: the node istio-cni leaves (the
// reference's rules in both backends, which pkg/istiocni judges to be
// exactly istio-cni's, and the hand-edited pod not), streams and sampled
// connections all through the stand-in; and the sampler catches a pod
// that loses its redirection (the control: otherwise a clean sampler
// would prove nothing).
func TestHarnessUnderIstioCNI(t *testing.T) {
	s := newScenario(t,
		podSpec{name: "legacy", backend: reference.Legacy},
		podSpec{name: "nft", backend: reference.NftCompat, unrelated: true},
		podSpec{name: "edited", backend: reference.Legacy, edit: editOneRule(reference.Legacy)})
	for _, p := range s.pods {
		r := istiocniPod(t, p.Pod)
		if want := p.spec.edit == nil; r.Equivalent != want {
			t.Errorf("%s: pkg/istiocni says Equivalent = %v (reasons %q), want %v", p.Name, r.Equivalent, r.Reasons, want)
		}
		if b := r.Backends(); len(b) != 1 || string(b[0]) != string(p.spec.backend) {
			t.Errorf("%s: istio-cni's rules found in %v, want only %s", p.Name, b, p.spec.backend)
		}
	}
	node, err := istiocni.New().InspectNode(t.Context(), simnode.NetnsPath(s.NodeNS))
	if err != nil {
		t.Fatal(err)
	}
	if len(node.Iptables) != 2 || !node.Iptables[0].Exact || !node.Iptables[1].Exact || node.Entries() != 2*len(s.pods) {
		t.Errorf("the node's istio-cni state: %+v", node)
	}

	st := startStreams(t)
	s.openStreams(st, "pre")
	sm := s.startSampler(t)
	sm.waitSamples(t, 100)
	sm.check(t, "under istio-cni")
	st.check("pre-")

	// The control: istio-cni's rules go from one pod; its new connections
	// are no longer redirected and the sampler must say so.
	victim := s.pods[0]
	s.ref.WithBackend(victim.spec.backend).Remove(t, victim.Pod)
	sm.waitSamples(t, 100)
	// Unredirected inbound dials hang until their deadline and slow the
	// sampler down (under load, or emulation), and a connection with no
	// record fails only after recordGrace: sample until the sampler saw
	// each of the victim's outbound families fail, or 60 s went by.
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		sm.settle(false)
		by := sm.failuresBy()
		seen := true
		for _, f := range families(victim.Pod) {
			seen = seen && by[victim.Name+" outbound "+f.name] > 0
		}
		if seen {
			break
		}
	}
	sm.halt()
	sm.settle(true)
	conns, n, first := sm.result()
	by, lost := sm.failuresBy(), sm.lostByWhat()
	t.Logf("sampler after removing %s's rules: %d connections, %d failures %v, lost inbound %v; first: %q", victim.Name, conns, n, by, lost, first[:min(3, len(first))])
	others := 0
	for key := range by {
		if !strings.HasPrefix(key, victim.Name+" ") {
			t.Errorf("%d failures of %s, a pod that kept its rules", by[key], key)
		}
	}
	for key, k := range lost {
		if !strings.HasPrefix(key, victim.Name+" ") {
			others += k
		}
	}
	if float64(others) > lostAllowed*float64(conns) {
		t.Errorf("%d inbound connections lost to pods that kept their rules (%v), more than the harness's %.1f%%", others, lost, lostAllowed*100)
	}
	// Both directions of the pod went unredirected, and the sampler saw
	// it: outbound in each family; inbound connections to the pod, once
	// the rules are gone under the stand-in, mostly hang until the dial's
	// deadline, so few are made.
	for _, f := range families(victim.Pod) {
		if key := victim.Name + " outbound " + f.name; by[key] == 0 {
			t.Errorf("the sampler saw no failure of %s while %s was unredirected", key, victim.Name)
		}
	}
	if by[victim.Name+" inbound ipv4"]+by[victim.Name+" inbound ipv6"]+lost[victim.Name+" inbound ipv4"]+lost[victim.Name+" inbound ipv6"] == 0 {
		t.Errorf("the sampler saw no inbound failure while %s was unredirected", victim.Name)
	}
}
