// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// agentRun is the real agent binary on a simulated node against the real
// API server: it runs in the test's own netns (so it reaches the API
// server on loopback) and works on the simulated node through
// --node-netns.
type agentRun struct {
	*agentrun.Node
	t  *testing.T
	c  *kubeapi.Cluster
	ns string
}

func newAgentRun(t *testing.T, c *kubeapi.Cluster, ns string) *agentRun {
	r := &agentRun{t: t, c: c, ns: ns, Node: agentrun.New(t, simnode.New(t), agentrun.Options{NodeName: newNode(),
		Kube:       &agentrun.Kube{Server: c.Config.Host, Token: c.Config.BearerToken, DaemonSetNamespace: ns, DaemonSetName: "ambient-ebpf"},
		InstallCNI: true, CallerNetns: true, LogLevel: "debug"})}
	// The primary CNI's config, which the installer chains into.
	if err := os.WriteFile(filepath.Join(r.CNIConfDir, "10-primary.conflist"),
		[]byte(`{"cniVersion": "1.0.0", "name": "primary", "plugins": [{"type": "ptp"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	return r
}

// start runs the agent and waits until it is ready.
func (r *agentRun) start(extra ...string) {
	r.t.Helper()
	r.StartAgent(r.t, extra...)
	if _, err := r.WaitReady(); err != nil {
		r.t.Fatal(err)
	}
}

func (r *agentRun) waitFor(what string, cond func() bool) {
	r.t.Helper()
	held := false
	testenv.Poll(30*time.Second, func() bool {
		held = cond()
		return held || (r.Agent != nil && r.Agent.Exited())
	})
	if !held {
		r.t.Fatalf("timed out waiting for %s; agent output:\n%s", what, r.Agent.Output.String())
	}
}

// pod creates a pod in the API (on this node) and on the simulated node,
// with the same UID and addresses; running marks it Running.
func (r *agentRun) pod(name string, running bool, annotations map[string]string) (*corev1.Pod, *simnode.Pod) {
	r.t.Helper()
	kp := r.c.Pod(r.t, kubeapi.PodSpec{Namespace: r.ns, Name: name, Node: r.NodeName, Annotations: annotations})
	idx := len(name) // any two distinct names below get distinct addresses
	sp := r.AddPodWith(name, r.ns, string(kp.UID),
		netip.AddrFrom4([4]byte{198, 18, 3, byte(10 + idx + int(name[0]))}),
		netip.MustParseAddr(fmt.Sprintf("fd00:198:18:3::%x", 10+idx+int(name[0]))))
	if running {
		kp = r.c.SetStatus(r.t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{sp.V4, sp.V6}})
	}
	return kp, sp
}

func (r *agentRun) annotation(kp *corev1.Pod) enrollment.Redirection {
	p, err := r.c.Client.CoreV1().Pods(kp.Namespace).Get(context.Background(), kp.Name, metav1.GetOptions{})
	if err != nil {
		return enrollment.Redirection("error: " + err.Error())
	}
	return enrollment.Redirection(p.Annotations[enrollment.RedirectionAnnotation])
}

func (r *agentRun) pinned() map[string]bool {
	out := map[string]bool{}
	view, err := inspect.OpenPinned(r.BPFFSDir)
	if err != nil {
		return out
	}
	defer view.Close()
	pods, _ := view.Pods()
	for _, p := range pods {
		out[p.Name] = true
	}
	return out
}

// The agent against a real API server, through its whole life: start-up
// with a snapshot and a pod to repair, a pod through the CNI channel,
// namespace label off and on, SIGKILL and restart, a stop while its
// DaemonSet exists (state kept), then uninstall (everything removed).
func TestAgentLifecycleAgainstAPIServer(t *testing.T) {
	c := requireCluster(t)
	ns := c.Namespace(t, "agent", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	r := newAgentRun(t, c, ns.Name)
	c.DaemonSet(t, ns.Name, "ambient-ebpf")

	// Before the agent: a pod a previous agent enrolled (annotated), and
	// one that started while no agent ran (to repair). Their apps run.
	old, oldNode := r.pod("old", true, map[string]string{enrollment.RedirectionAnnotation: string(enrollment.RedirectionEnabled)})
	late, lateNode := r.pod("late", true, nil)
	var lateApp *simnode.App
	for _, p := range []*simnode.Pod{oldNode, lateNode} {
		app := r.StartApp(p)
		app.Listen("tcp", p.Name, netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
		lateApp = app
	}
	zt := r.StartZtunnelFor(r.ZDS)
	r.start()
	r.waitFor("snapshot pod enrolled and the late pod repaired", func() bool {
		p := r.pinned()
		return p["old"] && p["late"]
	})
	r.waitFor("annotations enabled", func() bool {
		return r.annotation(old) == enrollment.RedirectionEnabled && r.annotation(late) == enrollment.RedirectionEnabled
	})
	ev, err := c.Client.CoreV1().Events(ns.Name).List(context.Background(), metav1.ListOptions{})
	if err != nil || !strings.Contains(fmt.Sprint(ev.Items), "RedirectionRepaired") {
		t.Errorf("no RedirectionRepaired event for the late pod (%v)", err)
	}
	out := r.StartOutsideApp()
	resp, err := out.Dial("tcp", simnode.AppRequest{Addr: netip.AddrPortFrom(lateNode.V4, 8080)})
	if err != nil {
		t.Fatal(err)
	}
	if rec, ok := zt.RecordFor(resp.Local); !ok || rec.Listener != standin.InboundPort {
		t.Errorf("inbound to the repaired pod did not go through ztunnel: %+v", rec)
	}

	// A new pod through the CNI plugin's channel, before its app starts.
	fresh, freshNode := r.pod("fresh", false, nil)
	cl, err := events.NewClient(r.CNI)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	add, err := cl.PodAdd(context.Background(), &cniv1.PodAddRequest{
		Pod: &cniv1.Pod{Name: "fresh", Namespace: ns.Name, Uid: string(fresh.UID), Netns: freshNode.NetnsPath(), Interface: "eth0"},
		Ips: []string{freshNode.V4.String(), freshNode.V6.String()}})
	if err != nil || !add.GetEnrolled() {
		t.Fatalf("CNI ADD: %+v, %v", add, err)
	}
	r.waitFor("fresh pod annotated", func() bool { return r.annotation(fresh) == enrollment.RedirectionEnabled })

	// Namespace label off: every pod leaves; on again: running pods return.
	setLabel := func(v *string) {
		cur, err := c.Client.CoreV1().Namespaces().Get(context.Background(), ns.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if v == nil {
			delete(cur.Labels, enrollment.DataplaneModeLabel)
		} else {
			cur.Labels[enrollment.DataplaneModeLabel] = *v
		}
		if _, err := c.Client.CoreV1().Namespaces().Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setLabel(nil)
	r.waitFor("pods removed", func() bool { return len(r.pinned()) == 0 && r.annotation(old) == "" })
	ambient := enrollment.DataplaneModeAmbient
	setLabel(&ambient)
	r.waitFor("running pods enrolled again", func() bool { p := r.pinned(); return p["old"] && p["late"] })

	// SIGKILL while a redirected stream runs and connections keep coming;
	// restart: nothing bypasses ztunnel, the stream never breaks.
	if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 9090)}); err != nil {
		t.Fatal(err)
	}
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	probe, err := simnode.StartTrafficProbe(lateApp, zt, netip.AddrPortFrom(simnode.OutsideV4, 9090), netip.AddrPortFrom(simnode.OutsideV4, 8080))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	r.Agent.Kill()
	if p := r.pinned(); !p["old"] || !p["late"] {
		t.Errorf("pins after SIGKILL: %v", p)
	}
	time.Sleep(time.Second)
	r.start()
	time.Sleep(500 * time.Millisecond)
	if conns, failures := probe.Stop(); len(failures) > 0 || conns < 10 {
		t.Errorf("around the SIGKILL restart: %d connections, failures %v", conns, failures[:min(5, len(failures))])
	}
	if r.annotation(old) != enrollment.RedirectionEnabled || r.annotation(late) != enrollment.RedirectionEnabled {
		t.Errorf("annotations after the restart: %q %q", r.annotation(old), r.annotation(late))
	}
	_, metrics := r.Get("/metrics")
	for _, want := range []string{"istio_cni_install_ready 1", `istio_cni_installs_total{result="SUCCESS"} 1`,
		`istio_cni_installs_total{result="CREATE_CNI_CONFIG_FAILURE"} 0`, "ambient_ebpf_enrolled_pods",
		`nodeagent_reconcile_events_total{type="add"}`, `istio_cni_repair_pods_repaired_total{result="fail",type="repair"} 0`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	if b, err := os.ReadFile(filepath.Join(r.CNIConfDir, "10-primary.conflist")); err != nil || !strings.Contains(string(b), "ambient-ebpf-cni") {
		t.Errorf("the plugin is not chained into the primary conflist: %s %v", b, err)
	}

	// Stop while the DaemonSet exists (an upgrade): everything stays.
	if err := r.Stop(15 * time.Second); err != nil {
		t.Error(err)
	}
	if p := r.pinned(); !p["old"] {
		t.Errorf("state lost on an upgrade-style stop: %v", p)
	}
	// A DaemonSet that selects the node by label: a stop keeps everything
	// while the label matches, and removes everything once it does not
	// (the node left the DaemonSet: a node-by-node move to istio-cni).
	const redirectorLabel = "ambient-ebpf.io/redirector"
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: r.NodeName, Labels: map[string]string{redirectorLabel: "ebpf"}}}
	if _, err := c.Client.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.CoreV1().Nodes().Delete(context.Background(), r.NodeName, metav1.DeleteOptions{}) })
	cur, err := c.Client.AppsV1().DaemonSets(ns.Name).Get(context.Background(), "ambient-ebpf", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Spec.Template.Spec.NodeSelector = map[string]string{redirectorLabel: "ebpf"}
	if _, err := c.Client.AppsV1().DaemonSets(ns.Name).Update(context.Background(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	r.start()
	if err := r.Stop(15 * time.Second); err != nil {
		t.Error(err)
	}
	if p := r.pinned(); !p["old"] {
		t.Errorf("state lost on a stop while the DaemonSet selects the node: %v", p)
	}
	r.start()
	patch := []byte(`{"metadata":{"labels":{"` + redirectorLabel + `":null}}}`)
	if _, err := c.Client.CoreV1().Nodes().Patch(context.Background(), r.NodeName, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := r.Stop(15 * time.Second); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(r.BPFFSDir); !os.IsNotExist(err) {
		t.Errorf("pins left after the node left the DaemonSet: %v", err)
	}
	// Uninstall: the DaemonSet is gone; the next stop removes everything.
	if err := c.Client.AppsV1().DaemonSets(ns.Name).Delete(context.Background(), "ambient-ebpf", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	r.start()
	if err := r.Stop(15 * time.Second); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(r.BPFFSDir); !os.IsNotExist(err) {
		t.Errorf("pins left after uninstall: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(r.CNIConfDir, "10-primary.conflist")); strings.Contains(string(b), "ambient-ebpf-cni") {
		t.Errorf("the plugin is still chained after uninstall: %s", b)
	}
	if _, err := os.Stat(filepath.Join(r.CNIBinDir, "ambient-ebpf-cni")); !os.IsNotExist(err) {
		t.Errorf("the plugin binary is still installed after uninstall: %v", err)
	}
}
