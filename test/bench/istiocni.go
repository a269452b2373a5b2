// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench && istiocnireal

package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// istioCNI is the enrolment figures' third column: the real istio-cni
// (Istio's install-cni and its chained plugin istio-cni, test/istiocnireal)
// on a simulated node of its own, against a real kube-apiserver, with the
// same ZDS peer as ours (the acker, in a helper of that node) and a
// runtime helper in its node netns that execs its plugin as ours is
// exec'd. Its pods are light pods of that node, each also a pod of an
// ambient namespace in the API server, created before the clock runs.
type istioCNI struct {
	t         *testing.T
	cluster   *kubeapi.Cluster
	node      *istiocnireal.Node
	light     *lightPods
	runtime   *simnode.Proc
	conflist  []byte
	namespace string
	// sandboxes are the pods' netns as the runtime names them (CNI_NETNS,
	// in the runtime's netns folder, which install-cni sees), by UID.
	sandboxes map[string]string
}

// startIstioCNI starts the API server and the real istio-cni's node;
// both go with t's cleanup. A missing binary fails the run (make bench
// builds them first).
func startIstioCNI(t *testing.T) *istioCNI {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	c, err := kubeapi.Start(ctx)
	cancel()
	c = kubeapi.Require(t, c, err)
	t.Cleanup(c.Stop)
	ic := &istioCNI{t: t, cluster: c, sandboxes: map[string]string{}}
	nodeName := "bench-istio-cni"
	ic.node = istiocnireal.StartNode(t, c, nodeName, func(n *simnode.Node, zds string) {
		zt := simnode.StartHelper(t, roleZtunnel, n.NodeNS, ic.cgroup(n, "ztunnel"))
		if err := call(zt, ztunnelRequest{Op: "zds", Socket: zds}, nil); err != nil {
			t.Fatalf("connect to install-cni over ZDS: %v", err)
		}
	})
	list, err := ic.node.Runtime.Conflist()
	if err != nil {
		t.Fatal(err)
	}
	ic.conflist = list.Bytes
	ic.namespace = c.Namespace(t, "bench", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}).Name
	ic.light = newLightPods(t, ic.node.Node)
	ic.runtime = simnode.StartHelper(t, roleRuntime, ic.node.Node.NodeNS, ic.cgroup(ic.node.Node, "runtime"))
	return ic
}

func (ic *istioCNI) cgroup(n *simnode.Node, name string) string {
	cg := filepath.Join(n.CgroupRoot, name)
	if err := os.Mkdir(cg, 0o755); err != nil {
		ic.t.Fatal(err)
	}
	return cg
}

// batch makes count pods prefix<i>: first in the API server (bound to
// the node, in the ambient namespace), then their netns and sandbox
// paths, so install-cni's informer has them before their ADD.
func (ic *istioCNI) batch(prefix string, count int) []*simnode.Pod {
	ic.t.Helper()
	pods := ic.light.plan(prefix, count)
	for _, p := range pods {
		kp := ic.cluster.Pod(ic.t, kubeapi.PodSpec{Namespace: ic.namespace, Name: p.Name, Node: ic.node.Name})
		p.Namespace, p.UID = kp.Namespace, string(kp.UID)
	}
	if err := ic.light.create(pods, false); err != nil {
		ic.t.Fatalf("make pods: %v", err)
	}
	for _, p := range pods {
		ic.sandboxes[p.UID] = ic.node.Runtime.Sandbox(p)
	}
	return pods
}

// cni has its runtime helper exec istio-cni (ADD or VERSION) for pods,
// conc calls in flight; an ADD holds when the pod's in-pod chains are
// committed (checkInpod).
func (ic *istioCNI) cni(command string, pods []*simnode.Pod, conc int) (cniResult, error) {
	req := cniRequest{Command: command, Conflist: ic.conflist, Plugin: istiocnireal.PluginBinary, BinDir: ic.node.Runtime.BinDir,
		Conc: conc, Check: checkInpod, Pods: toCNIPods(pods)}
	for i := range req.Pods {
		req.Pods[i].Netns = ic.sandboxes[req.Pods[i].UID]
	}
	var res cniResult
	if err := call(ic.runtime, req, &res); err != nil {
		out := ic.node.Agent.Process.Output.String()
		return res, fmt.Errorf("%w; install-cni's latest output:\n%s", err, out[max(0, len(out)-4000):])
	}
	return res, nil
}

// version names the binaries' istio.io/istio.
func (ic *istioCNI) version() string { return istiocnireal.Module + " " + ic.node.Bins.Version }
