// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build takeovercrash

// The crash tests of the takeover are out of make test (run them with make
// test-takeover-crash): now and then (about 1 run in 20 on the host, more
// on a loaded machine) one fails. Seen, and fixed:
//   - a SYN DNATed to 15006 that nobody answered held the restarted
//     agent's drain past the test's minute (conntrack keeps such an entry
//     two minutes): istiocni.RedirectedFlows counts replied entries only;
//   - a sampled connection "not redirected": istio-cni's REDIRECT had
//     remapped its client port (its redirected tuple clashed with that of
//     another connection from the same port still in conntrack), so the
//     stand-in's record was from another port. The sampler now asks the
//     pod's conntrack for it (remappedPeer).
//
// Still seen, not explained: after the restart at takeover-after-enroll
// (the legacy pod enrolled in eBPF with istio-cni's iptables-legacy rules
// still on it, no drain yet), new inbound connections to that pod are slow
// (a third as many samples as to the nft pod in one run, SYNs answered
// only when retransmitted) and one timed out (connect, 3 s).

package takeover

import (
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
)

// The failpoints of the takeover (pkg/agent, agent.FailpointEnv): the
// agent kills itself after enrolling a pod in eBPF, and after installing
// its drain table, before istio-cni's rules are removed.
var takeoverFailpoints = []string{"takeover-after-enroll", "takeover-after-drain"}

// The agent is killed (SIGKILL, by its failpoint) in the middle of a
// takeover, after enrolling a pod in eBPF or after installing its drain,
// with istio-cni's rules still there. Every pod stays redirected by one of
// the two, no stream breaks, and the agent started again finishes the
// takeover.
func TestTakeoverKilledMidwayFinishesOnRestart(t *testing.T) {
	for _, fp := range takeoverFailpoints {
		t.Run(fp, func(t *testing.T) {
			s := newScenario(t,
				podSpec{name: "legacy", backend: reference.Legacy},
				podSpec{name: "nft", backend: reference.NftCompat})
			st := startStreams(t)
			s.openStreams(st, "pre")
			sm := s.startSampler(t)
			sm.waitSamples(t, 50)

			s.handOverZDS()
			t.Setenv(agent.FailpointEnv, fp)
			s.StartAgent(t, takeoverFlags...)
			// Generous: under emulation loading the programs takes seconds.
			if !agentrun.WaitExit(s.Agent, 2*time.Minute) {
				s.Agent.Kill()
				t.Fatalf("the agent never reached %s:\n%s", fp, s.Agent.Output.String())
			}
			t.Setenv(agent.FailpointEnv, "")
			sm.waitSamples(t, 100) // no agent, half a takeover
			for _, p := range s.pods {
				pinned := s.pinned(t, p.Pod)
				if r := inspect(t, p.Pod); !pinned && len(r.Iptables) == 0 {
					t.Errorf("%s is neither enrolled in eBPF nor left with istio-cni's rules", p.Name)
				}
			}
			st.check("pre-")
			sm.check(t, "after the kill at "+fp)

			s.takeOver(t, sm)
			st.check("pre-")
			st.closeStreams("pre-")
			s.waitDrained(t, s.pods...)
			sm.check(t, "after the restart")
			if got := agentrun.PinnedPods(t, s.BPFFSDir); len(got) != len(s.pods) {
				t.Errorf("pinned pods after the restart: %+v", got)
			}
			if t.Failed() {
				t.Logf("the restarted agent's output:\n%s", s.Agent.Output.String())
			}
		})
	}
}
