// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The real agent is killed (SIGKILL, by its own failpoint) at every step of
// a CNI ADD's enrolment and a CNI DEL's removal in turn. Restarted, it
// leaves the pod fully redirected (killed after the last step) or as it
// was: the pod's own tcp_fwmark_accept, no policy rule, no pins. The
// runtime's retried ADD then works, and so does the DEL after it.
func TestAgentKilledAtEveryStepConverges(t *testing.T) {
	n := newAgentNode(t, "app")
	a := n.pods["app"]
	n.Sysctl(a.NS, "net/ipv4/tcp_fwmark_accept", "0")
	n.StartZtunnelFor(n.ZDS)
	// Enough for every enrolment's programs on any kernel.
	const maxPrograms = 5
	for _, step := range dataplane.Steps {
		nths := 1
		if step == dataplane.StepEnrollAttached {
			nths = maxPrograms
		}
		for nth := 1; nth <= nths; nth++ {
			t.Run(fmt.Sprintf("%s#%d", step, nth), func(t *testing.T) {
				remove := strings.HasPrefix(step, "remove/")
				t.Setenv(agent.FailpointEnv, fmt.Sprintf("%s#%d", step, nth))
				n.startConnectedAgent(t)
				_, addErr := n.podAdd(t, a)
				if remove {
					if addErr != nil {
						t.Fatalf("ADD: %v", addErr)
					}
					_ = n.tryPodDel(a)
				}
				died := testenv.Poll(5*time.Second, n.Agent.Exited)
				t.Setenv(agent.FailpointEnv, "")
				if !died {
					// This kernel has fewer programs per pod than nth:
					// the step was never reached. Clean up and move on.
					n.Agent.Kill()
					n.startConnectedAgent(t)
					_ = n.tryPodDel(a)
					n.checkUntouched(t, a)
					n.Agent.Terminate(5 * time.Second)
					return
				}
				n.startConnectedAgent(t)
				if step == dataplane.StepEnrollDone {
					if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 1 {
						t.Errorf("killed after enrolling: pins hold %+v, want the pod", got)
					}
				} else {
					n.checkUntouched(t, a)
				}
				if resp, err := n.podAdd(t, a); err != nil || !resp.GetEnrolled() {
					t.Fatalf("retried ADD: %+v, %v\n%s", resp, err, n.Agent.Output.String())
				}
				if got := fwmarkAccept(t, a); got != "1" {
					t.Errorf("tcp_fwmark_accept = %s while enrolled", got)
				}
				n.podDel(t, a)
				n.checkUntouched(t, a)
				n.Agent.Terminate(5 * time.Second)
			})
		}
	}
}

// The agent is killed from outside while a burst of ADDs and DELs is in
// flight, as a node reboot's pod starts meet an agent rollout. The runtime
// retries what failed; afterwards every pod is fully redirected or fully
// untouched, and no pin is left for a removed pod.
func TestAgentKilledDuringABurstConverges(t *testing.T) {
	names := make([]string, 16)
	for i := range names {
		names[i] = fmt.Sprintf("p%d", i)
	}
	n := newAgentNode(t, names...)
	n.StartZtunnelFor(n.ZDS)
	n.startConnectedAgent(t)
	pods := make([]*simnode.Pod, len(names))
	for i, name := range names {
		pods[i] = n.pods[name]
	}
	leaving, coming := pods[:8], pods[8:]
	for _, p := range leaving {
		if _, err := n.podAdd(t, p); err != nil {
			t.Fatalf("ADD %s: %v", p.Name, err)
		}
	}
	var wg sync.WaitGroup
	for i := range leaving {
		wg.Add(2)
		go func() { defer wg.Done(); _ = n.tryPodDel(leaving[i]) }()
		go func() { defer wg.Done(); _, _ = n.tryPodAdd(coming[i]) }()
	}
	time.Sleep(3 * time.Millisecond)
	n.Agent.Kill()
	wg.Wait()

	n.startConnectedAgent(t)
	for i := range leaving {
		if err := n.tryPodDel(leaving[i]); err != nil {
			t.Errorf("retried DEL %s: %v", leaving[i].Name, err)
		}
		if resp, err := n.tryPodAdd(coming[i]); err != nil || !resp.GetEnrolled() {
			t.Errorf("retried ADD %s: %+v, %v", coming[i].Name, resp, err)
		}
	}
	got := map[string]bool{}
	for _, p := range agentrun.PinnedPods(t, n.BPFFSDir) {
		got[p.Name] = true
	}
	for _, p := range coming {
		if !got[p.Name] {
			t.Errorf("%s is not enrolled after the retries", p.Name)
		}
	}
	for _, p := range leaving {
		if got[p.Name] {
			t.Errorf("%s is still enrolled after its DEL", p.Name)
		}
		n.checkUntouched(t, p)
	}
	for _, p := range coming {
		n.podDel(t, p)
		n.checkUntouched(t, p)
	}
}

// startConnectedAgent starts the agent and waits until ztunnel (started
// by the test) is connected to it.
func (n *agentNode) startConnectedAgent(t *testing.T, extra ...string) {
	t.Helper()
	n.StartReadyAgent(t, extra...)
	n.WaitZtunnel(t)
}

func (n *agentNode) tryPodAdd(p *simnode.Pod) (*cniv1.PodAddResponse, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := &cniv1.PodAddRequest{
		Pod: &cniv1.Pod{Name: p.Name, Namespace: p.Namespace, Uid: p.UID, ContainerId: "sandbox-" + p.Name, Netns: p.NetnsPath(), Interface: "eth0"},
		Ips: []string{p.V4.String(), p.V6.String()},
	}
	if n.grpcCNI {
		return grpcCNIPodAdd(ctx, n.CNI, req)
	}
	c, err := events.NewClient(n.CNI)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return c.PodAdd(ctx, req)
}

func (n *agentNode) tryPodDel(p *simnode.Pod) error {
	return n.delPod(&cniv1.Pod{Name: p.Name, Namespace: p.Namespace, Uid: p.UID, Netns: p.NetnsPath()})
}

// checkUntouched asserts the pod is as before enrolment: not pinned, no
// pin directory, its own tcp_fwmark_accept (0), no return-path rule.
func (n *agentNode) checkUntouched(t *testing.T, p *simnode.Pod) {
	t.Helper()
	for _, e := range agentrun.PinnedPods(t, n.BPFFSDir) {
		if e.UID == p.UID {
			t.Errorf("%s still pinned", p.Name)
		}
	}
	if _, err := os.Stat(filepath.Join(n.BPFFSDir, "pods", p.UID)); !os.IsNotExist(err) {
		t.Errorf("%s: pin directory left: %v", p.Name, err)
	}
	if got := fwmarkAccept(t, p); got != "0" {
		t.Errorf("%s: tcp_fwmark_accept = %s, want the pod's own 0", p.Name, got)
	}
	rules := 0
	if err := simnode.InNetns(p.NS, func() error {
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			rs, err := netlink.RuleList(fam)
			if err != nil {
				return err
			}
			for _, r := range rs {
				if r.Table == 100 {
					rules++
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if rules != 0 {
		t.Errorf("%s: %d return-path rules left", p.Name, rules)
	}
}

func fwmarkAccept(t *testing.T, p *simnode.Pod) string {
	t.Helper()
	var v []byte
	if err := simnode.InNetns(p.NS, func() (err error) {
		v, err = os.ReadFile("/proc/sys/net/ipv4/tcp_fwmark_accept")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(v))
}
