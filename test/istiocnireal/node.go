// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"os"
	"testing"

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
}

// StartNode makes a fresh simulated node with the primary network
// (NewRuntime, PluginsDir), starts install-cni for nodeName against c
// with the chart's ambient defaults (Start), waits until it is ready, has
// connect start the caller's ZDS peer at the agent's socket in the node,
// and waits until the agent counts it connected. Binaries of go.mod's
// version are required (Require); everything goes with tb's cleanup.
func StartNode(tb testing.TB, c *kubeapi.Cluster, nodeName string, connect func(n *simnode.Node, zds string)) *Node {
	tb.Helper()
	bins := Require(tb)
	n := simnode.New(tb)
	r := NewRuntime(tb, n, "", "", PluginsDir(tb))
	a := Start(tb, r, bins, Options{Cluster: c, NodeName: nodeName})
	if _, err := a.WaitReady(); err != nil {
		tb.Fatal(err)
	}
	connect(n, a.ZDS)
	if err := a.WaitZtunnel(); err != nil {
		tb.Fatal(err)
	}
	return &Node{Name: nodeName, Bins: bins, Node: n, Runtime: r, Agent: a}
}
