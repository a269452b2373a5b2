// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"

	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// PluginsDirEnv names the folder of the primary network's plugins
// (PrimaryPlugins), which `make cni-plugins` builds and the make targets
// of the real istio-cni export.
const PluginsDirEnv = "CNI_PLUGINS_DIR"

// PluginsDir is $CNI_PLUGINS_DIR, or fails tb naming the make target.
func PluginsDir(tb testing.TB) string {
	tb.Helper()
	dir := os.Getenv(PluginsDirEnv)
	if dir == "" {
		tb.Fatalf("%s is not set: run make test-istio-cni or make bench (they build the plugins with make cni-plugins)", PluginsDirEnv)
	}
	return dir
}

// Node is the real istio-cni on a simulated node of its own: the
// runtime's CNI side, and install-cni ready with a ZDS peer connected.
type Node struct {
	Name    string // the node's name in the API server
	Bins    Bins
	Node    *simnode.Node
	Runtime *Runtime
	Agent   *Agent
	// PIDNamespace is the node's PID namespace (Options.PIDNamespace),
	// where install-cni runs and where a pod's pause process must run for
	// install-cni to find the pod's netns from /proc.
	PIDNamespace int
}

// StartNode makes a fresh simulated node with the primary network
// (NewRuntime, PluginsDir) and a PID namespace (StartPIDNamespace),
// starts install-cni for nodeName against c in that namespace with the
// chart's ambient defaults (Start), waits until it is ready, has
// connect start the caller's ZDS peer at the agent's socket in the node,
// and waits until the agent counts it connected. Each of before runs on
// the fresh node first, for what a node has before istio-cni comes (other
// programs' rules, say). Binaries of go.mod's version are required
// (Require); everything goes with tb's cleanup.
func StartNode(tb testing.TB, c *kubeapi.Cluster, nodeName string, connect func(n *simnode.Node, zds string), before ...func(*simnode.Node)) *Node {
	tb.Helper()
	return StartNodeWith(tb, c, Options{NodeName: nodeName}, connect, before...)
}

// StartNodeWith is StartNode with o's chart values and environment (its
// Cluster and PIDNamespace are set here).
func StartNodeWith(tb testing.TB, c *kubeapi.Cluster, o Options, connect func(n *simnode.Node, zds string), before ...func(*simnode.Node)) *Node {
	tb.Helper()
	nodeName := o.NodeName
	bins := Require(tb)
	n := simnode.New(tb)
	for _, f := range before {
		f(n)
	}
	pidns := StartPIDNamespace(tb, n)
	r := NewRuntime(tb, n, "", "", PluginsDir(tb))
	o.Cluster, o.PIDNamespace = c, pidns
	a := Start(tb, r, bins, o)
	if _, err := a.WaitReady(); err != nil {
		tb.Fatal(err)
	}
	connect(n, a.ZDS)
	if err := a.WaitZtunnel(); err != nil {
		tb.Fatal(err)
	}
	return &Node{Name: nodeName, Bins: bins, Node: n, Runtime: r, Agent: a, PIDNamespace: pidns}
}

// StartPIDNamespace starts the node's init: PID 1 of a new PID namespace,
// in the node netns and a cgroup of its own below the node's, and returns
// its PID as the test sees it. At tb's cleanup it is killed, and with it
// everything still running in the namespace (processes entered there by
// nsenter --pid outlive their nsenter otherwise).
func StartPIDNamespace(tb testing.TB, n *simnode.Node) int {
	tb.Helper()
	cg := filepath.Join(n.CgroupRoot, "init")
	if err := os.Mkdir(cg, 0o755); err != nil {
		tb.Fatalf("create cgroup: %v", err)
	}
	// The init is sleep under the name kubelet: istio-cni's native
	// nftables mode matches the node's probes by kubelet's uid, which it
	// takes from a process named kubelet in /host/proc, and refuses to
	// start without one.
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		tb.Fatal(err)
	}
	b, err := os.ReadFile(sleep)
	if err != nil {
		tb.Fatal(err)
	}
	kubelet := filepath.Join(tb.TempDir(), "kubelet")
	if err := os.WriteFile(kubelet, b, 0o755); err != nil {
		tb.Fatal(err)
	}
	p := simnode.StartProcess(tb, n.NodeNS, cg, "unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--", kubelet, "infinity")
	var pid int
	testenv.Poll(10*time.Second, func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", p.PID(), p.PID()))
		if err == nil {
			pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		}
		return err == nil || p.Exited()
	})
	if pid == 0 {
		tb.Fatalf("the node's PID namespace did not start; unshare's output:\n%s", p.Output.String())
	}
	tb.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	return pid
}
