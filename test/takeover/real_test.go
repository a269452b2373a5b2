//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// realScenario is a node the real istio-cni redirects (test/istiocnireal:
// its install-cni, its plugin chained after the primary network, its ZDS
// server the stand-in's peer), with the agent ready to start on the same
// node against the same API server.
type realScenario struct {
	*scenario
	istio   *istiocnireal.Node
	cluster *kubeapi.Cluster
	kpods   []*corev1.Pod
}

// newRealScenario starts a kube-apiserver, the real istio-cni on a fresh
// node and adds the named pods, in a namespace labelled ambient, as
// kubelet does: the pod in the API, its pause process (in the node's PID
// namespace, where install-cni finds pods after a restart), its sandbox
// through the CNI chain, its status Running with the chain's addresses;
// each is annotated enabled by istio-cni before the apps start.
func newRealScenario(t *testing.T, names ...string) *realScenario {
	t.Helper()
	return newRealScenarioWith(t, istiocnireal.AmbientProfile, names...)
}

// newRealScenarioWith is newRealScenario with istio-cni's chart values.
func newRealScenarioWith(t *testing.T, values string, names ...string) *realScenario {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	c, err := kubeapi.Start(ctx)
	cancel()
	if err != nil {
		t.Fatalf("kube-apiserver (make kube-bins): %v", err)
	}
	t.Cleanup(c.Stop)
	nodeName := "takeover-" + testenv.RunID()
	var zt *simnode.Ztunnel
	in := istiocnireal.StartNodeWith(t, c, istiocnireal.Options{NodeName: nodeName, Values: values}, func(n *simnode.Node, zds string) { zt = n.StartZtunnelFor(zds) })
	an := agentrun.New(t, in.Node, agentrun.Options{NodeName: nodeName, CallerNetns: true, LogLevel: "debug",
		Kube: &agentrun.Kube{Server: c.Config.Host, Token: c.Config.BearerToken, DaemonSetNamespace: ourDaemonSet.Namespace, DaemonSetName: ourDaemonSet.Name}})
	// ztunnel's socket is the node's one path, whoever serves it.
	an.ZDS = in.Agent.ZDS
	rs := &realScenario{scenario: &scenario{Node: an, zt: zt}, istio: in, cluster: c}
	ns := c.Namespace(t, "takeover", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	for _, name := range names {
		kp := c.Pod(t, kubeapi.PodSpec{Namespace: ns.Name, Name: name, Node: nodeName})
		p := in.Node.AddBarePod(kp.Name, kp.Namespace, string(kp.UID))
		in.Node.StartPause(p, in.PIDNamespace)
		res, err := in.Runtime.Add(p, in.Runtime.Sandbox(p))
		if err != nil {
			t.Fatalf("ADD %s through istio-cni's chain: %v\ninstall-cni:\n%s", name, err, in.Agent.Process.Output.String())
		}
		setFromResult(p, res)
		c.SetStatus(t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: p.IPs()})
		if got := c.WaitAnnotation(t, kp, enrollment.RedirectionAnnotation, string(enrollment.RedirectionEnabled), 30*time.Second); got != string(enrollment.RedirectionEnabled) {
			t.Fatalf("%s: istio-cni annotated it %q\ninstall-cni:\n%s", name, got, in.Agent.Process.Output.String())
		}
		rs.pods = append(rs.pods, &tpod{Pod: p})
		rs.kpods = append(rs.kpods, kp)
	}
	rs.startApps(t)
	return rs
}

// setFromResult takes the pod's addresses and host-side veth from the
// chain's result.
func setFromResult(p *simnode.Pod, res *current.Result) {
	for _, ip := range res.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok {
			if a = a.Unmap(); a.Is4() {
				p.V4 = a
			} else {
				p.V6 = a
			}
		}
	}
	for _, ifc := range res.Interfaces {
		if ifc.Sandbox == "" {
			p.HostVeth = ifc.Name
		}
	}
}

// checkIstioCNIRules asserts every pod holds exactly istio-cni's rules,
// in the backends given.
func (rs *realScenario) checkIstioCNIRules(t *testing.T, when string, b ...istiocni.Backend) {
	t.Helper()
	for _, p := range rs.pods {
		r := istiocniPod(t, p.Pod)
		if !r.Equivalent || !slices.Equal(r.Backends(), b) {
			t.Errorf("%s %s: istio-cni's rules in %v, want %v; Equivalent %v (%q)", p.Name, when, r.Backends(), b, r.Equivalent, r.Reasons)
		}
	}
}

// moveToEBPF runs steps 1 and 2 of the runbook: ambient-ebpf's
// DaemonSet selecting nodes labelled for it, the node labelled, which
// istio-cni's agent leaves (its pods' rules stay); then the agent starts
// with flags and takes every pod over. It checks that the pods keep
// istio-cni's rules while no agent runs, and hold nothing of istio-cni's
// afterwards, nor the node.
func (rs *realScenario) moveToEBPF(t *testing.T, sm *sampler, flags ...string) {
	t.Helper()
	rs.cluster.EnsureNamespace(t, ourDaemonSet.Namespace)
	rs.cluster.DaemonSetOn(t, ourDaemonSet.Namespace, ourDaemonSet.Name, map[string]string{redirectorLabel: "ebpf"})
	t.Cleanup(func() {
		_ = rs.cluster.Client.AppsV1().DaemonSets(ourDaemonSet.Namespace).Delete(context.Background(), ourDaemonSet.Name, metav1.DeleteOptions{})
	})
	var before []string
	for _, p := range rs.pods {
		before = append(before, fmt.Sprint(istiocniPod(t, p.Pod).Backends()))
	}
	if err := rs.istio.Agent.LeaveNode(redirectorLabel, "ebpf"); err != nil {
		t.Fatal(err)
	}
	for i, p := range rs.pods {
		if r := istiocniPod(t, p.Pod); !r.Equivalent || fmt.Sprint(r.Backends()) != before[i] {
			t.Errorf("%s after istio-cni left: its rules in %v, before %s; Equivalent %v (%q)", p.Name, r.Backends(), before[i], r.Equivalent, r.Reasons)
		}
	}
	sm.waitSamples(t, 20) // no agent at all
	rs.takeOver(t, sm, flags...)
}

// moveBack runs the runbook's way back: the node's label goes, so the
// agent, no longer selected by its DaemonSet, hands the pods back in
// iptables-nft (its --istio-cni-handback) as it stops, and istio-cni's
// DaemonSet schedules install-cni on the node again.
func (rs *realScenario) moveBack(t *testing.T, sm *sampler) {
	t.Helper()
	rs.setNodeLabel(t, "")
	if !rs.Agent.Terminate(3 * time.Minute) {
		t.Errorf("the agent did not hand back and exit cleanly:\n%s", rs.Agent.Output.String())
	}
	if out := rs.Agent.Output.String(); !strings.Contains(out, "handed back to istio-cni") {
		t.Errorf("the agent left the node without handing back:\n%s", out)
	}
	rs.checkIstioCNIRules(t, "after the hand-back", istiocni.NftCompat)
	sm.waitSamples(t, 20) // on istio-cni's rules, no agent
	if err := rs.istio.Agent.ReturnToNode(redirectorLabel); err != nil {
		t.Fatal(err)
	}
	if err := rs.istio.Agent.WaitZtunnel(); err != nil {
		t.Fatal(err)
	}
	sm.waitSamples(t, 100)
}

// rollAgent restarts the agent as a rolling update of its DaemonSet
// does (the DaemonSet present, its node selector matching: it keeps the
// node's state), with the same flags.
func (rs *realScenario) rollAgent(t *testing.T, flags ...string) {
	t.Helper()
	if !rs.Agent.Terminate(10 * time.Second) {
		t.Errorf("the agent did not stop on SIGTERM:\n%s", rs.Agent.Output.String())
	}
	rs.StartReadyAgent(t, flags...)
	rs.WaitZtunnel(t)
}

// setNodeLabel sets (value non-empty) or removes the runbook's label.
func (rs *realScenario) setNodeLabel(t *testing.T, value string) {
	t.Helper()
	nodes := rs.cluster.Client.CoreV1().Nodes()
	n, err := nodes.Get(context.Background(), rs.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if value == "" {
		delete(n.Labels, redirectorLabel)
	} else {
		n.Labels[redirectorLabel] = value
	}
	if _, err := nodes.Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// redirectorLabel is the runbook's node label (README, docs/TAKEOVER.md).
const redirectorLabel = "ambient-ebpf.io/redirector"

// ourDaemonSet is the DaemonSet the agent's uninstall check looks for.
var ourDaemonSet = struct{ Namespace, Name string }{"istio-system", "ambient-ebpf"}

// The item 5, as the README's runbook runs it: a node the real
// istio-cni redirects (two pods it enrolled through its own plugin, its
// probe rule and ipsets, its ZDS connection) moves to ambient-ebpf and
// back, with live streams both ways and both families and the sampler of
// new connections throughout:
//
//   - istio-cni has had a rolling update on the node (so its rules are
//     in both iptables backends, istio/istio#61020);
//   - the node is labelled for ambient-ebpf: istio-cni's DaemonSet, whose
//     node affinity excludes such nodes, leaves it (its plugin and node
//     rules go, the pods' rules stay), and ambient-ebpf's, selecting
//     them, starts there and takes every pod and ztunnel over;
//   - ambient-ebpf has a rolling update;
//   - the label goes: ambient-ebpf's agent, no longer selected, hands the
//     pods back (its chart's handBack, iptables-nft) and uninstalls, and
//     istio-cni's DaemonSet schedules install-cni on the node again: it
//     finds its rules in the pods and serves ztunnel every pod again.
//
// No stream breaks and no sampled connection goes unredirected at any
// moment, the stretches with no agent at all on the node included.
func TestTakeoverFromTheRealIstioCNIAndBack(t *testing.T) {
	rs := newRealScenario(t, "a", "b")
	istio := rs.istio.Agent
	rs.checkIstioCNIRules(t, "under istio-cni", istiocni.NftCompat)
	if err := istio.Restart(); err != nil {
		t.Fatal(err)
	}
	if _, err := istio.WaitReady(); err != nil {
		t.Fatal(err)
	}
	if err := istio.WaitZtunnel(); err != nil {
		t.Fatal(err)
	}
	both := []istiocni.Backend{istiocni.Legacy, istiocni.NftCompat}
	rs.checkIstioCNIRules(t, "after a rolling update of istio-cni", both...)
	st := startStreams(t)
	rs.openStreams(st, "pre")
	sm := rs.startSampler(t)
	sm.waitSamples(t, 50)
	sm.check(t, "under istio-cni")

	flags := []string{"--istio-cni-takeover=true", "--istio-cni-handback=" + string(istiocni.NftCompat)}
	rs.moveToEBPF(t, sm, flags...)
	st.check("pre-")
	sm.check(t, "across the takeover")
	logStatus(t, rs.scenario)

	rs.rollAgent(t, flags...)
	rs.openStreams(st, "mid") // under eBPF, to live across the hand-back
	sm.waitSamples(t, 50)
	st.check("pre-", "mid-")
	sm.check(t, "across ambient-ebpf's rolling update")

	// Back: the label goes; the DaemonSet controller would stop the agent.
	rs.moveBack(t, sm)
	// Its start writes its rules in iptables-legacy again, as after any
	// restart of its on this node.
	rs.checkIstioCNIRules(t, "with istio-cni back", both...)
	for i, p := range rs.pods {
		if hasDrain(t, p) {
			t.Errorf("%s: the drain table is left after the hand-back", p.Name)
		}
		checkNoPrograms(t, rs.scenario, p.Pod)
		if got := rs.cluster.WaitAnnotation(t, rs.kpods[i], enrollment.RedirectionAnnotation, string(enrollment.RedirectionEnabled), time.Second); got != string(enrollment.RedirectionEnabled) {
			t.Errorf("%s: annotated %q with istio-cni back", p.Name, got)
		}
	}
	rs.checkNodeHandedBack(t)
	if _, err := os.Stat(rs.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after the hand-back: %v", err)
	}
	st.check("pre-", "mid-")
	sm.check(t, "across the hand-back and istio-cni's start")
	if t.Failed() {
		t.Logf("the hand-back agent's output:\n%s", rs.Agent.Output.String())
		t.Logf("install-cni's output:\n%s", istio.Process.Output.String())
	}
}

// With istio-cni's native nftables backend (global.nativeNftables) the
// pods' rules are its istio-ambient-* nftables tables: the agent takes
// them over as iptables rules, with the same guarantees, and nothing of
// istio-cni's stays in the pods or on the node. The way back writes
// iptables rules (iptables-nft): istio-cni, configured for native
// nftables, finds them (its probe ipsets) when it starts, keeps its
// iptables backend until the node reboots, as after its own migration
// from iptables, and serves every pod (writing its rules again in
// iptables-legacy too, as after every start but a node's first).
func TestTakeoverFromTheRealIstioCNIWithNativeNftablesAndBack(t *testing.T) {
	rs := newRealScenarioWith(t, istiocnireal.NativeNftablesValues, "a", "b")
	istio := rs.istio.Agent
	rs.checkIstioCNIRules(t, "under istio-cni", istiocni.Nftables)
	st := startStreams(t)
	rs.openStreams(st, "pre")
	sm := rs.startSampler(t)
	sm.waitSamples(t, 50)
	sm.check(t, "under istio-cni")
	rs.moveToEBPF(t, sm, "--istio-cni-takeover=true", "--istio-cni-handback="+string(istiocni.NftCompat))
	st.check("pre-")
	sm.check(t, "across the takeover")
	logStatus(t, rs.scenario)

	rs.moveBack(t, sm)
	if out := istio.Process.Output.String(); !strings.Contains(out, "continuing with iptables backend") {
		t.Errorf("install-cni did not keep the iptables backend it found:\n%s", out)
	}
	rs.checkIstioCNIRules(t, "with istio-cni back", istiocni.Legacy, istiocni.NftCompat)
	for _, p := range rs.pods {
		checkNoPrograms(t, rs.scenario, p.Pod)
	}
	st.check("pre-")
	sm.check(t, "across the hand-back and istio-cni's start")
	if t.Failed() {
		t.Logf("the agent's output:\n%s", rs.Agent.Output.String())
		t.Logf("install-cni's output:\n%s", istio.Process.Output.String())
	}
}
