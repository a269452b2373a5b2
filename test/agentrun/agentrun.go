// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agentrun runs the real agent binary on a simulated node in
// standalone mode, with its pods described in a pod file: what the suites
// that drive the agent from outside (test/agente2e, test/takeover) share.
package agentrun

import (
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Main is TestMain of a suite that runs the agent: helper roles of
// simnode first, then the tests, with no RLIMIT_MEMLOCK limit for the
// agents it starts, as a container runtime commonly grants: kernels before
// 5.11 charge BPF memory to it per user, and v0.1.0's agent probes the
// kernel's features before it lifts the limit itself (HEAD's lifts it
// first).
func Main(m *testing.M) {
	simnode.RunHelper()
	if err := rlimit.RemoveMemlock(); err != nil {
		fmt.Fprintln(os.Stderr, "remove memlock limit:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// NodeName is the node the agent runs as, and the pod file's pods are on.
const NodeName = "node-1"

// Node is a simulated node with the agent's binary built and its sockets
// and pod file placed in a directory of the test's.
type Node struct {
	*simnode.Node
	Dir, PodFile, ZDS, CNI, Inspect string
	Bin                             string
	Agent                           *simnode.Process // the last one started
	// Wrapper runs before the agent's command line, which it execs
	// (prlimit with its options, say); none when empty.
	Wrapper []string
}

// New builds the agent binary for a node and names its files; the pod
// file is the caller's to write.
func New(t *testing.T, n *simnode.Node) *Node {
	t.Helper()
	dir := t.TempDir()
	return &Node{Node: n, Dir: dir, PodFile: filepath.Join(dir, "pods.yaml"),
		ZDS: filepath.Join(dir, "ztunnel.sock"), CNI: filepath.Join(dir, "cni.sock"), Inspect: filepath.Join(dir, "inspect.sock"),
		Bin: simnode.BuildBinary(t, dir, "github.com/ambient-ebpf/ambient-ebpf/cmd/ambient-ebpf-agent")}
}

// AgentArgs is the command line of n.Bin on this node.
func (n *Node) AgentArgs(extra ...string) []string {
	return append([]string{n.Bin, "--standalone-pods", n.PodFile, "--node-name", NodeName,
		"--bpffs-dir", n.BPFFSDir, "--cgroup-root", n.CgroupRoot, "--node-netns", simnode.NetnsPath(n.NodeNS),
		"--zds-socket", n.ZDS, "--cni-socket", n.CNI, "--inspect-socket", n.Inspect,
		"--install-cni=false", "--log-level", "debug"}, extra...)
}

// StartAgent starts the agent in the node netns without waiting for it.
func (n *Node) StartAgent(t *testing.T, extra ...string) {
	t.Helper()
	n.Agent = simnode.StartProcess(t, n.NodeNS, "", append(slices.Clone(n.Wrapper), n.AgentArgs(extra...)...)...)
}

// StartReadyAgent starts the agent and waits until it is ready and every
// listener of it answers.
func (n *Node) StartReadyAgent(t *testing.T, extra ...string) {
	t.Helper()
	n.StartAgent(t, extra...)
	// Generous: under emulation (hack/vmtest) loading the programs alone
	// takes seconds.
	var code int
	testenv.Poll(2*time.Minute, func() bool {
		code, _ = n.Get("/readyz")
		return code == http.StatusOK || n.Agent.Exited()
	})
	if code != http.StatusOK {
		t.Fatalf("agent not ready; output:\n%s", n.Agent.Output.String())
	}
	for _, s := range []struct{ network, path string }{
		{"unixpacket", n.ZDS}, {"unix", n.CNI}, {"unix", n.Inspect},
	} {
		c, err := net.Dial(s.network, s.path)
		if err != nil {
			t.Fatalf("agent ready but %s does not answer: %v", s.path, err)
		}
		_ = c.Close()
	}
}

// Get fetches a path from the agent's health (:8000) or metrics (:15014)
// server inside the node netns.
func (n *Node) Get(path string) (int, string) {
	port := "8000"
	if path == "/metrics" {
		port = "15014"
	}
	code, body, err := simnode.HTTPGet(n.NodeNS, "http://"+net.JoinHostPort("127.0.0.1", port)+path)
	if err != nil {
		return 0, err.Error()
	}
	return code, body
}

// WaitZtunnel waits until ztunnel (started by the test) is connected to
// the agent.
func (n *Node) WaitZtunnel(t *testing.T) {
	t.Helper()
	testenv.Eventually(t, time.Minute, "ztunnel connected", func() bool {
		_, body := n.Get("/metrics")
		return strings.Contains(body, "\nztunnel_connected 1\n")
	})
}

// PodEntry is a pod of the pod file: the simulated pod, its annotations
// (nil: none), and whether its status has its IPs (a running pod's, as
// the API server has them; without, the agent learns them from the CNI
// plugin's ADD).
type PodEntry struct {
	*simnode.Pod
	Annotations map[string]string
	StatusIPs   bool
}

// PodFile renders a pod file: the ambient namespace "default" and the
// pods in it, on NodeName; pods named plain* opt out.
func PodFile(pods ...PodEntry) string {
	var b strings.Builder
	b.WriteString("apiVersion: v1\nkind: Namespace\nmetadata: {name: default, labels: {istio.io/dataplane-mode: ambient}}\n")
	for _, p := range pods {
		meta := ""
		if strings.HasPrefix(p.Name, "plain") {
			meta = "labels: {istio.io/dataplane-mode: none}, "
		}
		if len(p.Annotations) > 0 {
			var kv []string
			for _, k := range slices.Sorted(maps.Keys(p.Annotations)) {
				kv = append(kv, fmt.Sprintf("%s: %q", k, p.Annotations[k]))
			}
			meta += "annotations: {" + strings.Join(kv, ", ") + "}, "
		}
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: %s, namespace: default, %suid: %s}\nspec: {nodeName: %s, serviceAccountName: %s-sa}\n",
			p.Name, meta, p.UID, NodeName, p.Name)
		if p.StatusIPs {
			fmt.Fprintf(&b, "status: {podIP: %s, podIPs: [{ip: %s}, {ip: %s}]}\n", p.V4, p.V4, p.V6)
		}
	}
	return b.String()
}

// Entries are pods without annotations, for PodFile.
func Entries(pods ...*simnode.Pod) []PodEntry {
	out := make([]PodEntry, len(pods))
	for i, p := range pods {
		out[i] = PodEntry{Pod: p}
	}
	return out
}

// PinnedPods lists the pods enrolled in the pins below dir (none when
// nothing is pinned).
func PinnedPods(t *testing.T, dir string) []dataplane.EnrolledPod {
	t.Helper()
	view, err := dataplane.OpenPinned(dir)
	if err != nil {
		return nil
	}
	defer view.Close()
	pods, err := view.Pods()
	if err != nil {
		t.Fatal(err)
	}
	return pods
}
