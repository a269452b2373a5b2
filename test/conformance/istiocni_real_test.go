// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build istiocnireal

package conformance

import (
	"context"
	"fmt"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// realBackends: built with the istiocnireal tag (make test), the rows
// also run on the real istio-cni (make istio-cni-bins), which the
// reference must agree with.
func realBackends() []backend { return []backend{&istiocniBackend{}} }

// istiocniBackend is the real istio-cni: install-cni with the chart's
// ambient defaults on the node, against a kube-apiserver of its own, with
// the stand-in as its ZDS peer. A pod is enrolled as istio-cni enrols a
// running pod that turns ambient, from its informer: the pod exists in the
// API server (in a namespace labelled ambient, its per-pod switches as
// annotations), its pause process runs in the node's PID namespace in a
// cgroup named by its UID (how install-cni finds its netns), and its
// status turns Running with its addresses (istio-cni's probe ipsets hold
// them). The rows' pods already have their network, so the primary CNI
// and istio-cni's plugin are not called; test/differential compares the
// plugin's path. Removal is the user's: the pod labelled out of the mesh
// while it runs, or deleted once its network is gone (H4).
type istiocniBackend struct {
	c        *kubeapi.Cluster
	agent    *istiocnireal.Agent
	zt       *simnode.Ztunnel
	node     *simnode.Node
	nodeName string
	ns       string
	pidns    int
	pods     map[*simnode.Pod]*corev1.Pod
}

func (*istiocniBackend) name() string { return "istio-cni" }

func (b *istiocniBackend) setup(t *testing.T, n *simnode.Node) {
	t.Helper()
	bins := istiocnireal.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	c, err := kubeapi.Start(ctx)
	cancel()
	if err != nil {
		t.Fatalf("kube-apiserver (make kube-bins): %v", err)
	}
	t.Cleanup(c.Stop)
	b.c, b.node, b.pods = c, n, map[*simnode.Pod]*corev1.Pod{}
	b.nodeName = "conformance-" + testenv.RunID()
	b.pidns = istiocnireal.StartPIDNamespace(t, n)
	r := istiocnireal.NewRuntime(t, n, "", "", istiocnireal.PluginsDir(t))
	b.agent = istiocnireal.Start(t, r, bins, istiocnireal.Options{Cluster: c, NodeName: b.nodeName, PIDNamespace: b.pidns})
	if _, err := b.agent.WaitReady(); err != nil {
		t.Fatal(err)
	}
	b.ns = c.Namespace(t, "conformance", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}).Name
}

func (b *istiocniBackend) startZtunnel(t *testing.T, n *simnode.Node) *simnode.Ztunnel {
	t.Helper()
	b.zt = n.StartZtunnelFor(b.agent.ZDS)
	if err := b.agent.WaitZtunnel(); err != nil {
		t.Fatal(err)
	}
	return b.zt
}

func (b *istiocniBackend) enroll(t *testing.T, p *simnode.Pod, o podOpts) {
	t.Helper()
	ann := map[string]string{enrollment.DNSCaptureAnnotation: strconv.FormatBool(o.dns)}
	if o.ingressMode {
		ann[enrollment.BypassInboundAnnotation] = "true"
	}
	if len(o.reroute) > 0 {
		ann[enrollment.RerouteInterfacesAnnotation] = strings.Join(o.reroute, ",")
	}
	kp := b.c.Pod(t, kubeapi.PodSpec{Namespace: b.ns, Name: p.Name, Node: b.nodeName, Annotations: ann})
	// The API server names the pod's UID; its sandbox's cgroup carries it.
	p.UID, p.Namespace, p.Cgroup = string(kp.UID), kp.Namespace, ""
	b.node.StartPause(p, b.pidns)
	kp = b.c.SetStatus(t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: p.IPs()})
	b.pods[p] = kp
	if got := b.c.WaitAnnotation(t, kp, enrollment.RedirectionAnnotation, string(enrollment.RedirectionEnabled), 30*time.Second); got != string(enrollment.RedirectionEnabled) {
		t.Fatalf("%s: istio-cni annotated it %q\ninstall-cni:\n%s", p.Name, got, b.agent.Process.Output.String())
	}
}

func (b *istiocniBackend) remove(t *testing.T, p *simnode.Pod) {
	t.Helper()
	kp := b.pods[p]
	if kp == nil {
		t.Fatalf("remove %s: not enrolled here", p.Name)
	}
	delete(b.pods, p)
	if b.hasNetwork(p) {
		body := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, enrollment.DataplaneModeLabel, enrollment.DataplaneModeNone)
		if _, err := b.c.Client.CoreV1().Pods(kp.Namespace).Patch(context.Background(), kp.Name, types.MergePatchType, []byte(body), metav1.PatchOptions{}); err != nil {
			t.Fatalf("label pod %s out of the mesh: %v", p.Name, err)
		}
		if got := b.c.WaitAnnotation(t, kp, enrollment.RedirectionAnnotation, string(enrollment.RedirectionNone), 30*time.Second); got != string(enrollment.RedirectionNone) {
			t.Fatalf("%s: still annotated %q after leaving the mesh\ninstall-cni:\n%s", p.Name, got, b.agent.Process.Output.String())
		}
	} else {
		// As the kubelet finishes a deletion: no grace period left.
		var now int64
		if err := b.c.Client.CoreV1().Pods(kp.Namespace).Delete(context.Background(), kp.Name, metav1.DeleteOptions{GracePeriodSeconds: &now}); err != nil {
			t.Fatalf("delete pod %s: %v", p.Name, err)
		}
	}
	// Removed once ztunnel was told.
	if !testenv.Poll(30*time.Second, func() bool { return b.ztunnelDeleted(t, p) }) {
		t.Fatalf("%s: ztunnel was never told the pod left\ninstall-cni:\n%s", p.Name, b.agent.Process.Output.String())
	}
}

// hasNetwork says whether the pod's host-side veth is still there.
func (b *istiocniBackend) hasNetwork(p *simnode.Pod) bool {
	return exec.Command("ip", "-n", b.node.NodeNS, "link", "show", "dev", p.HostVeth).Run() == nil
}

func (b *istiocniBackend) ztunnelDeleted(t *testing.T, p *simnode.Pod) bool {
	tr, err := b.zt.Transcript()
	if err != nil {
		t.Fatal(err)
	}
	return slices.ContainsFunc(tr, func(m zdsclient.Observed) bool { return m.Kind == "del" && m.UID == p.UID })
}
