// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// The crash tests of the takeover. Out of make test for a while (stops 24
// to 27) because one failed now and then; what they found, fixed:
//   - a SYN DNATed to 15006 that nobody answered held the restarted
//     agent's drain past the test's minute (conntrack keeps such an entry
//     two minutes): istiocni.RedirectedFlows counts replied entries only;
//   - a sampled connection "not redirected": istio-cni's REDIRECT had
//     remapped its client port (its redirected tuple clashed with that of
//     another connection from the same port still in conntrack), so the
//     stand-in's record was from another port. The sampler now asks the
//     pod's conntrack for it (remappedPeer);
//   - new inbound connections to the legacy pod slow or refused after the
//     restart at takeover-after-enroll (the restart adopts the enrolled
//     pod): a running pod's enrolment switched its sk_lookup capture on
//     before ztunnel's listeners were filed (pkg/dataplane,
//     TestAClientAtTheEnrolmentOfARunningPodReachesZtunnel).
// Back in make test since: 12 runs in a row passed on the host (the last 6
// with all three failpoints, most of them beside an emulated 5.10 kernel
// suite loading both cores).

package takeover

import (
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/takeover"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
)

// The failpoints of the takeover (pkg/agent, agent.FailpointEnv), each
// the first time a pod reaches it: the agent kills itself after installing
// a pod's drain table, after enrolling it in eBPF (istio-cni's rules still
// there), and after removing istio-cni's rules from it (the node's probe
// entries still there).
var takeoverFailpoints = takeover.Steps

// The agent is killed (SIGKILL, by its failpoint) in the middle of a
// takeover: after installing a pod's drain, after enrolling it in eBPF, or
// after removing istio-cni's rules from it. Every pod stays redirected by
// one of the two, no stream breaks, and the agent started again finishes
// the takeover.
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
			if !testenv.Poll(2*time.Minute, s.Agent.Exited) {
				s.Agent.Kill()
				t.Fatalf("the agent never reached %s:\n%s", fp, s.Agent.Output.String())
			}
			t.Setenv(agent.FailpointEnv, "")
			sm.waitSamples(t, 100) // no agent, half a takeover
			for _, p := range s.pods {
				pinned := s.pinned(t, p.Pod)
				if r := istiocniPod(t, p.Pod); !pinned && len(r.Iptables) == 0 {
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
