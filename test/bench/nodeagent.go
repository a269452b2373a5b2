// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// nodeAgent is the real agent binary (cmd/ambient-ebpf-agent), built for
// the run, serving the simulated node as its DaemonSet pod would
// (agentrun): standalone with a pod file, in the node netns and a cgroup
// of its own, health and metrics on the node netns's loopback. Its
// installer chains the real CNI plugin (cmd/ambient-ebpf-cni) into a
// primary conflist; the runtime helper execs it from there.
type nodeAgent struct {
	*agentrun.Node
	t      *testing.T
	cgroup string
	flags  []string // the extra flags of the latest start
}

const (
	benchNodeName = "bench-node"
	// iptablesPlugin is test/reference/iptables-cni: istio-cni's iptables
	// enrollment, exec'd like ambient-ebpf-cni.
	iptablesPlugin = "iptables-cni"
)

// newNodeAgent builds the binaries, writes the pod file naming pods (all
// in ambient namespaces) and the primary CNI's conflist; start runs it.
func newNodeAgent(t *testing.T, n *simnode.Node, cgroup string, pods []*simnode.Pod) *nodeAgent {
	t.Helper()
	a := &nodeAgent{t: t, cgroup: cgroup, Node: agentrun.New(t, n, agentrun.Options{NodeName: benchNodeName, InstallCNI: true,
		Cgroup: cgroup, HealthAddr: "127.0.0.1:8000", MetricsAddr: "127.0.0.1:15014", ReadyPoll: 5 * time.Millisecond})}
	simnode.BuildBinary(t, a.CNIBinDir, "github.com/ambient-ebpf/ambient-ebpf/test/reference/"+iptablesPlugin)
	if err := writePodFile(a.PodFile, pods); err != nil {
		t.Fatalf("write pod file: %v", err)
	}
	// The primary CNI's conflist (ptp + host-local, never run here: the
	// pods' interfaces are made by lightPods and simnode, and the runtime
	// helper passes what ptp would have returned as prevResult).
	primary := fmt.Sprintf(`{"cniVersion": "1.1.0", "name": "bench", "plugins": [
  {"type": "ptp", "mtu": 1500, "ipam": {"type": "host-local", "dataDir": %q,
   "ranges": [[{"subnet": "198.18.64.0/18"}], [{"subnet": "fd00:198:18:2::/64"}]]}}]}`, filepath.Join(a.Dir, "ipam"))
	if err := os.WriteFile(filepath.Join(a.CNIConfDir, "10-bench.conflist"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	return a
}

// writePodFile writes the standalone pod file: the pods' namespaces,
// labelled ambient, and the pods on this node.
func writePodFile(path string, pods []*simnode.Pod) error {
	var objs []any
	var namespaces []string
	for _, p := range pods {
		if !slices.Contains(namespaces, p.Namespace) {
			namespaces = append(namespaces, p.Namespace)
			objs = append(objs, &corev1.Namespace{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Namespace"},
				ObjectMeta: metav1.ObjectMeta{Name: p.Namespace, Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}})
		}
	}
	for _, p := range pods {
		objs = append(objs, &corev1.Pod{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
			ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: types.UID(p.UID)},
			Spec:       corev1.PodSpec{NodeName: benchNodeName, ServiceAccountName: "bench"}})
	}
	var b bytes.Buffer
	for _, o := range objs {
		y, err := yaml.Marshal(o)
		if err != nil {
			return err
		}
		b.WriteString("---\n")
		b.Write(y)
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}

// start runs the agent (extra flags appended) and returns when /readyz
// answers 200, with the time from the exec.
func (a *nodeAgent) start(extra ...string) time.Duration {
	a.t.Helper()
	a.exec(extra...)
	return a.waitReady()
}

// exec starts the agent and returns when.
func (a *nodeAgent) exec(extra ...string) time.Time {
	a.t.Helper()
	a.StartAgent(a.t, extra...)
	a.flags = extra
	return a.Started
}

// waitReady waits until /readyz answers 200 and returns the time since
// the exec.
func (a *nodeAgent) waitReady() time.Duration {
	a.t.Helper()
	took, err := a.WaitReady()
	if err != nil {
		a.t.Fatal(err)
	}
	return took
}

// stop sends SIGTERM and fails the test unless the agent exits cleanly.
func (a *nodeAgent) stop() {
	a.t.Helper()
	if err := a.Stop(time.Minute); err != nil {
		a.t.Fatal(err)
	}
}

// status is `ambient-ebpf status`: the agent's view over the inspection
// socket and the pinned maps' count.
func (a *nodeAgent) status() cli.Status {
	a.t.Helper()
	var out bytes.Buffer
	cmd := cli.NewCommand(&out)
	cmd.SetErr(io.Discard)
	cmd.SetArgs([]string{"--bpffs", a.BPFFSDir, "--inspect-socket", a.Inspect, "-o", "json", "status"})
	// Not ready yet is a report too (the command then exits non-zero).
	if err := cmd.Execute(); err != nil && !errors.Is(err, cli.ErrUnhealthy) {
		a.t.Fatalf("ambient-ebpf status: %v", err)
	}
	var st cli.Status
	if err := json.Unmarshal(out.Bytes(), &st); err != nil {
		a.t.Fatalf("ambient-ebpf status: %v: %s", err, out.String())
	}
	return st
}

// waitFor polls status until cond holds.
func (a *nodeAgent) waitFor(what string, cond func(cli.Status) bool) {
	a.t.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(10 * time.Millisecond) {
		st := a.status()
		if st.Agent != nil && cond(st) {
			return
		}
		if time.Now().After(deadline) {
			a.t.Fatalf("agent: timed out waiting for %s (status %+v); its output:\n%s", what, st, a.Agent.Output.String())
		}
	}
}

// metric reads one unlabelled sample (or the sum of a histogram's
// name_sum, name_count) from /metrics.
func (a *nodeAgent) metric(name string) float64 {
	a.t.Helper()
	code, body := a.Get("/metrics")
	if code != http.StatusOK {
		a.t.Fatalf("agent metrics: %d %s", code, body)
	}
	for l := range strings.Lines(body) {
		if rest, ok := strings.CutPrefix(l, name+" "); ok {
			v, _ := strconv.ParseFloat(strings.TrimSpace(rest), 64)
			return v
		}
	}
	return 0
}

// conflists returns the conflist the installer wrote (primary +
// ambient-ebpf-cni) and the same list with iptables-cni in our plugin's
// place, as istio-cni would be chained.
func (a *nodeAgent) conflists() (ebpfList, iptablesList []byte) {
	a.t.Helper()
	files, err := libcni.ConfFiles(a.CNIConfDir, []string{".conflist"})
	if err != nil || len(files) != 1 {
		a.t.Fatalf("conflists in %s: %v, %v", a.CNIConfDir, files, err)
	}
	list, err := libcni.NetworkConfFromFile(files[0])
	if err != nil {
		a.t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(list.Bytes, &doc); err != nil {
		a.t.Fatal(err)
	}
	plugins, _ := doc["plugins"].([]any)
	i := slices.IndexFunc(plugins, func(p any) bool { m, _ := p.(map[string]any); return m["type"] == plugin.PluginType })
	if i < 0 {
		a.t.Fatalf("the installer did not chain %s into %s", plugin.PluginType, list.Bytes)
	}
	plugins[i] = map[string]any{"type": iptablesPlugin, "dnsCapture": true}
	ipt, err := json.Marshal(doc)
	if err != nil {
		a.t.Fatal(err)
	}
	return list.Bytes, ipt
}
