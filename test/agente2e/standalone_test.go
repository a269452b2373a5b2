// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agente2e runs the real agent binary on a simulated node: pods
// arrive through the CNI channel, ztunnel (the stand-in) receives them over
// ZDS, and real traffic shows what the data path did.
package agente2e

import (
	"bytes"
	"context"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

func TestMain(m *testing.M) { agentrun.Main(m) }

// agentNode is a simulated node running the real agent in standalone mode,
// with pods described in a pod file (all in the ambient namespace
// "default"; pods named plain* opt out).
type agentNode struct {
	*agentrun.Node
	pods map[string]*simnode.Pod
	// grpcCNI: the agent running is of a release that served the CNI
	// channel as gRPC (grpccni_test.go), asked as its own plugin did.
	grpcCNI bool
}

func newAgentNode(t *testing.T, names ...string) *agentNode {
	n := &agentNode{Node: agentrun.New(t, simnode.New(t), agentrun.Options{LogLevel: "debug"}), pods: map[string]*simnode.Pod{}}
	var pods []*simnode.Pod
	for _, name := range names {
		n.pods[name] = n.AddPod(name)
		pods = append(pods, n.pods[name])
	}
	if err := os.WriteFile(n.PodFile, []byte(podFile(pods...)), 0o644); err != nil {
		t.Fatal(err)
	}
	return n
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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if n.grpcCNI {
		return grpcCNIPodDel(ctx, n.CNI, &cniv1.PodDelRequest{Pod: p})
	}
	c, err := events.NewClient(n.CNI)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.PodDel(ctx, &cniv1.PodDelRequest{Pod: p})
}

func podFile(pods ...*simnode.Pod) string { return agentrun.PodFile(agentrun.Entries(pods...)...) }

// The whole path on one node: CNI ADD enrolls an ambient pod (and leaves a
// non-ambient one alone), ztunnel gets it over ZDS, its traffic goes through
// ztunnel, health and metrics answer, DEL removes it, and an uninstall
// leaves nothing pinned.
func TestAgentEnrollsThroughCNIAndZDS(t *testing.T) {
	n := newAgentNode(t, "app", "plain")
	a, plain := n.pods["app"], n.pods["plain"]
	n.StartReadyAgent(t, "--uninstall-on-exit", "--per-pod-metrics")
	zt := n.StartZtunnelFor(n.ZDS)

	// Fail closed is the plugin's side; here: ambient pods need ztunnel.
	n.WaitZtunnel(t)
	resp, err := n.podAdd(t, a)
	if err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD of the ambient pod: %+v, %v; agent:\n%s", resp, err, n.Agent.Output.String())
	}
	resp, err = n.podAdd(t, plain)
	if err != nil || resp.GetEnrolled() {
		t.Fatalf("ADD of the opted-out pod: %+v, %v", resp, err)
	}
	if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 1 || got[0].UID != a.UID {
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
	cmd.SetArgs([]string{"--bpffs", n.BPFFSDir, "--inspect-socket", n.Inspect, "-o", "json", "status"})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("ambient-ebpf status: %v", err)
	}
	for _, want := range []string{`"ready": true`, `"ztunnelConnections": 1`, `"enrolledPods": 1`, `"pendingPods": 0`, `"pinnedPods": 1`, `"tcx": true`} {
		if !strings.Contains(status.String(), want) {
			t.Errorf("status lacks %s:\n%s", want, status.String())
		}
	}
	if code, _ := n.Get("/healthz"); code != http.StatusOK {
		t.Errorf("/healthz = %d", code)
	}
	_, metrics := n.Get("/metrics")
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
	if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 0 {
		t.Errorf("pinned pods after DEL = %+v", got)
	}
	if err := n.Stop(10 * time.Second); err != nil {
		t.Error(err)
	}
	if _, err := os.Stat(n.BPFFSDir); !os.IsNotExist(err) {
		t.Errorf("pins left after uninstall: %v", err)
	}
}
