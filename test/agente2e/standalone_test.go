// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agente2e runs the real agent binary on a simulated node: pods
// arrive through the CNI channel, ztunnel (the stand-in) receives them over
// ZDS, and real traffic shows what the data path did.
package agente2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

func TestMain(m *testing.M) {
	simnode.RunHelper()
	// The agents this starts inherit no RLIMIT_MEMLOCK limit, as a
	// container runtime commonly grants: kernels before 5.11 charge BPF
	// memory to it per user, and v0.1.0's agent probes the kernel's
	// features before it lifts the limit itself (HEAD's lifts it first).
	if err := rlimit.RemoveMemlock(); err != nil {
		fmt.Fprintln(os.Stderr, "remove memlock limit:", err)
		os.Exit(1)
	}
	os.Exit(m.Run())
}

// agentNode is a simulated node running the real agent in standalone mode,
// with pods described in a pod file (all in the ambient namespace
// "default"; pods named plain* opt out).
type agentNode struct {
	*simnode.Node
	dir, podFile, zds, cni string
	bin                    string
	agent                  *simnode.Process
	pods                   map[string]*simnode.Pod
}

func newAgentNode(t *testing.T, names ...string) *agentNode {
	n := &agentNode{Node: simnode.New(t), dir: t.TempDir(), pods: map[string]*simnode.Pod{}}
	var pods []*simnode.Pod
	for _, name := range names {
		n.pods[name] = n.AddPod(name)
		pods = append(pods, n.pods[name])
	}
	n.podFile = filepath.Join(n.dir, "pods.yaml")
	if err := os.WriteFile(n.podFile, []byte(podFile(pods...)), 0o644); err != nil {
		t.Fatal(err)
	}
	n.zds = filepath.Join(n.dir, "ztunnel.sock")
	n.cni = filepath.Join(n.dir, "cni.sock")
	n.bin = simnode.BuildBinary(t, n.dir, "github.com/ambient-ebpf/ambient-ebpf/cmd/ambient-ebpf-agent")
	return n
}

// agentArgs is the command line of n.bin on this node.
func (n *agentNode) agentArgs(extra ...string) []string {
	return append([]string{n.bin, "--standalone-pods", n.podFile, "--node-name", "node-1",
		"--bpffs-dir", n.BPFFSDir, "--cgroup-root", n.CgroupRoot, "--node-netns", simnode.NetnsPath(n.NodeNS),
		"--zds-socket", n.zds, "--cni-socket", n.cni, "--inspect-socket", filepath.Join(n.dir, "inspect.sock"),
		"--install-cni=false", "--log-level", "debug"}, extra...)
}

func (n *agentNode) startAgent(t *testing.T, extra ...string) {
	t.Helper()
	n.agent = simnode.StartProcess(t, n.NodeNS, "", n.agentArgs(extra...)...)
	// Generous: under emulation (hack/vmtest) loading the programs alone
	// takes seconds.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if code, _ := n.get("/readyz"); code == http.StatusOK {
			// Ready means every listener is up.
			for _, s := range []struct{ network, path string }{
				{"unixpacket", n.zds}, {"unix", n.cni}, {"unix", filepath.Join(n.dir, "inspect.sock")},
			} {
				c, err := net.Dial(s.network, s.path)
				if err != nil {
					t.Fatalf("agent ready but %s does not answer: %v", s.path, err)
				}
				_ = c.Close()
			}
			return
		}
		if n.agent.Exited() || time.Now().After(deadline) {
			t.Fatalf("agent not ready; output:\n%s", n.agent.Output.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// get fetches a path from the agent's health (:8000) or metrics (:15014)
// server inside the node netns.
func (n *agentNode) get(path string) (int, string) {
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

// podAdd is the CNI plugin's call for a pod sandbox.
func (n *agentNode) podAdd(t *testing.T, p *simnode.Pod) (*cniv1.PodAddResponse, error) {
	t.Helper()
	return n.tryPodAdd(p)
}

func (n *agentNode) podDel(t *testing.T, p *simnode.Pod) {
	t.Helper()
	n.del(t, &cniv1.Pod{Name: p.Name, Namespace: p.Namespace, Uid: p.UID, Netns: p.NetnsPath()})
}

// del is the CNI plugin's DEL call with what the runtime gave.
func (n *agentNode) del(t *testing.T, p *cniv1.Pod) {
	t.Helper()
	if err := n.delPod(p); err != nil {
		t.Fatalf("pod DEL %v: %v", p, err)
	}
}

// delPod is the CNI plugin's DEL of a pod sandbox.
func (n *agentNode) delPod(p *cniv1.Pod) error {
	c, err := events.NewClient(n.cni)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.PodDel(ctx, &cniv1.PodDelRequest{Pod: p})
}

func podFile(pods ...*simnode.Pod) string {
	var b strings.Builder
	b.WriteString("apiVersion: v1\nkind: Namespace\nmetadata: {name: default, labels: {istio.io/dataplane-mode: ambient}}\n")
	for _, p := range pods {
		label := ""
		if strings.HasPrefix(p.Name, "plain") {
			label = "labels: {istio.io/dataplane-mode: none}, "
		}
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: %s, namespace: default, %suid: %s}\nspec: {nodeName: node-1, serviceAccountName: %s-sa}\n",
			p.Name, label, p.UID, p.Name)
	}
	return b.String()
}

func pinnedPods(t *testing.T, dir string) []dataplane.EnrolledPod {
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

// The whole path on one node: CNI ADD enrolls an ambient pod (and leaves a
// non-ambient one alone), ztunnel gets it over ZDS, its traffic goes through
// ztunnel, health and metrics answer, DEL removes it, and an uninstall
// leaves nothing pinned.
func TestAgentEnrollsThroughCNIAndZDS(t *testing.T) {
	n := newAgentNode(t, "app", "plain")
	a, plain := n.pods["app"], n.pods["plain"]
	n.startAgent(t, "--uninstall-on-exit", "--per-pod-metrics")
	zt := n.StartZtunnelFor(n.zds)

	// Fail closed is the plugin's side; here: ambient pods need ztunnel.
	n.waitZtunnel(t)
	resp, err := n.podAdd(t, a)
	if err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD of the ambient pod: %+v, %v; agent:\n%s", resp, err, n.agent.Output.String())
	}
	resp, err = n.podAdd(t, plain)
	if err != nil || resp.GetEnrolled() {
		t.Fatalf("ADD of the opted-out pod: %+v, %v", resp, err)
	}
	if got := pinnedPods(t, n.BPFFSDir); len(got) != 1 || got[0].UID != a.UID {
		t.Fatalf("pinned pods = %+v, want only %s", got, a.Name)
	}

	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	app := n.StartApp(a)
	dst := netip.AddrPortFrom(simnode.OutsideV4, 8080)
	r, err := app.Dial("tcp", simnode.AppRequest{Addr: dst})
	if err != nil {
		t.Fatalf("outbound dial: %v", err)
	}
	if rec, ok := zt.RecordFor(r.Local); !ok || rec.Listener != standin.OutboundPort || rec.OrigDst != dst {
		t.Errorf("outbound connection did not go through ztunnel: %+v", rec)
	}

	var status bytes.Buffer
	cmd := cli.NewCommand(&status)
	cmd.SetArgs([]string{"--bpffs", n.BPFFSDir, "--inspect-socket", filepath.Join(n.dir, "inspect.sock"), "-o", "json", "status"})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("ambient-ebpf status: %v", err)
	}
	for _, want := range []string{`"ready": true`, `"ztunnelConnections": 1`, `"enrolledPods": 1`, `"pendingPods": 0`, `"pinnedPods": 1`, `"tcx": true`} {
		if !strings.Contains(status.String(), want) {
			t.Errorf("status lacks %s:\n%s", want, status.String())
		}
	}
	if code, _ := n.get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d", code)
	}
	_, metrics := n.get("/metrics")
	for _, want := range []string{
		`istio_cni_plugin_requests_total{response_code="200"} 2`,
		`istio_cni_plugin_requests_total{response_code="500"} 0`,
		"ambient_ebpf_enrolled_pods 1",
		"ztunnel_connected 1",
		`ambient_ebpf_redirects_total{kind="outbound"} 1`,
		`ambient_ebpf_pod_redirects_total{kind="outbound",namespace="default",pod="app"} 1`,
		`ambient_ebpf_bpf_errors_total{kind="inbound_no_listener"} 0`,
		"ambient_ebpf_enroll_duration_seconds_count 1",
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	n.podDel(t, a)
	if got := pinnedPods(t, n.BPFFSDir); len(got) != 0 {
		t.Errorf("pinned pods after DEL = %+v", got)
	}
	if !n.agent.Terminate(10 * time.Second) {
		t.Errorf("agent did not stop cleanly:\n%s", n.agent.Output.String())
	}
	if _, err := os.Stat(n.BPFFSDir); !os.IsNotExist(err) {
		t.Errorf("pins left after uninstall: %v", err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
