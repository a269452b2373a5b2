// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agentrun runs the real agent binary (cmd/ambient-ebpf-agent) on
// a simulated node: the one runner of every suite that drives the agent
// from outside (test/agente2e, test/takeover, test/kubee2e), of the
// benchmark (test/bench) and of the demo. It builds the binary (or takes
// a prebuilt one), writes its command line (sockets, bpffs, cgroup root,
// pod file or API server, CNI installer), starts it in the node netns,
// waits until it is ready, reads its health and metrics, and stops it by
// PID. It takes a simnode.TB, so that a program (the demo) runs it too;
// the waits return errors for the caller to word.
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

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
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

// NodeName is the node the agent runs as by default, and the one PodFile's
// pods are on.
const NodeName = "node-1"

// The binaries a run uses, by file name: the agent, and the CNI plugin
// its installer installs with the fallback it copies from beside it.
const (
	agentBinary    = "ambient-ebpf-agent"
	pluginBinary   = "ambient-ebpf-cni"
	fallbackBinary = "ambient-ebpf-cni-fallback"
	module         = "github.com/ambient-ebpf/ambient-ebpf/cmd/"
)

// readyTimeout bounds a start: generous, since under emulation
// (hack/vmtest) loading the programs alone takes seconds.
const readyTimeout = 2 * time.Minute

// Options is how a run differs from the default one: standalone with a pod
// file in the node's directory, node NodeName, no CNI installation, in the
// node netns and the caller's cgroup, health and metrics on the agent's
// default addresses, logging at the agent's default level.
type Options struct {
	// BinDir holds prebuilt binaries, as `make build` leaves them in bin/;
	// empty: they are built for the run.
	BinDir   string
	NodeName string // empty: NodeName
	// PodFile is the standalone pod file; empty: pods.yaml in the node's
	// directory, for the caller to write. Ignored with Kube.
	PodFile string
	// Kube runs the agent against an API server instead of a pod file.
	Kube *Kube
	// InstallCNI lets the agent's installer chain the plugin into the
	// primary conflist the caller writes in CNIConfDir and copy it to
	// CNIBinDir; without, --install-cni=false.
	InstallCNI bool
	// OwnedConflist is --cni-owned-conflist with InstallCNI; empty: the
	// plugin is chained into the primary conflist in place, where the
	// tests on this harness look for it.
	OwnedConflist string
	// CallerNetns runs the agent in the caller's netns (to reach an API
	// server on loopback), working on the node through --node-netns; its
	// health and metrics then listen on free loopback ports.
	CallerNetns bool
	Cgroup      string // the cgroup the agent runs in; empty: the caller's
	// HealthAddr and MetricsAddr are --health-addr and --metrics-addr;
	// empty: the agent's defaults (:8000, :15014).
	HealthAddr, MetricsAddr string
	LogLevel                string // --log-level; empty: the agent's default
	// ReadyPoll is how often WaitReady asks /readyz; zero: testenv.Poll's
	// interval. The benchmark asks more often: it measures the time.
	ReadyPoll time.Duration
}

// Kube is the API server an agent watches, and its DaemonSet there.
type Kube struct {
	Server, Token string // URL and bearer token (TLS unverified)
	// PluginServer is the API server's URL as the node netns reaches it,
	// for the CNI plugin's kubeconfig (--api-server); empty: Server.
	// CA is its serving certificate (--ca-path); empty: none (the
	// plugin then cannot read pods from it).
	PluginServer                      string
	CA                                []byte
	DaemonSetNamespace, DaemonSetName string
}

// Node is a simulated node with the agent's files in a directory of its
// own: the binary, the sockets, the pod file, the CNI directories.
type Node struct {
	*simnode.Node
	opts     Options
	NodeName string
	Dir      string
	// Bin is the agent binary the next start runs (a test swaps it to
	// upgrade); Plugin is the CNI plugin it installs (with InstallCNI).
	Bin, Plugin       string
	PodFile           string
	ZDS, CNI, Inspect string // the agent's sockets
	// CNIBinDir and CNIConfDir are the host's CNI directories the
	// installer writes (with InstallCNI): the caller puts the primary
	// CNI's plugins and conflist there.
	CNIBinDir, CNIConfDir string
	// Wrapper runs before the agent's command line, which it execs
	// (prlimit with its options, say); none when empty.
	Wrapper []string
	// Omit lists flags Args leaves out (as "--flag" or "--flag=value"):
	// a release older than the flag refuses it.
	Omit    []string
	Agent   *simnode.Process // the last one started
	Started time.Time        // when Agent was exec'd
	http    *http.Client
}

// New names a node's agent files in a directory of t's and builds the
// binaries unless o.BinDir has them; the pod file and a primary conflist
// are the caller's to write.
func New(t simnode.TB, n *simnode.Node, o Options) *Node {
	t.Helper()
	dir := t.TempDir()
	a := &Node{Node: n, opts: o, NodeName: o.NodeName, Dir: dir, PodFile: o.PodFile,
		ZDS: filepath.Join(dir, "ztunnel.sock"), CNI: filepath.Join(dir, "cni.sock"), Inspect: filepath.Join(dir, "inspect.sock")}
	if a.NodeName == "" {
		a.NodeName = NodeName
	}
	if a.PodFile == "" {
		a.PodFile = filepath.Join(dir, "pods.yaml")
	}
	bins := []string{agentBinary}
	if o.InstallCNI {
		bins = append(bins, pluginBinary, fallbackBinary)
		a.CNIBinDir, a.CNIConfDir = filepath.Join(dir, "cni-bin"), filepath.Join(dir, "net.d")
		for _, d := range []string{a.CNIBinDir, a.CNIConfDir} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	for _, b := range bins {
		path := filepath.Join(o.BinDir, b)
		if o.BinDir == "" {
			path = simnode.BuildBinary(t, dir, module+b)
		}
		switch b {
		case agentBinary:
			a.Bin = path
		case pluginBinary:
			a.Plugin = path
		}
	}
	if o.Kube != nil {
		if err := a.writeKubeconfig(); err != nil {
			t.Fatal(err)
		}
	}
	if o.CallerNetns {
		a.http = &http.Client{Timeout: 2 * time.Second}
		for _, addr := range []*string{&a.opts.HealthAddr, &a.opts.MetricsAddr} {
			if *addr == "" {
				*addr = freePort(t)
			}
		}
	} else {
		c, closeHTTP, err := simnode.HTTPClient(n.NodeNS)
		if err != nil {
			t.Fatalf("http client in netns %s: %v", n.NodeNS, err)
		}
		t.Cleanup(closeHTTP)
		a.http = c
	}
	return a
}

func freePort(t simnode.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// writeKubeconfig writes the agent's kubeconfig and the token the
// installer puts in the plugin's.
func (n *Node) writeKubeconfig() error {
	k := n.opts.Kube
	kc := fmt.Sprintf("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: %q, insecure-skip-tls-verify: true}}]\n"+
		"users: [{name: u, user: {token: %q}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n",
		k.Server, k.Token)
	if err := os.WriteFile(filepath.Join(n.Dir, "kubeconfig"), []byte(kc), 0o600); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	if err := os.WriteFile(filepath.Join(n.Dir, "ca.crt"), k.CA, 0o600); err != nil {
		return fmt.Errorf("write ca: %w", err)
	}
	if err := os.WriteFile(filepath.Join(n.Dir, "token"), []byte(k.Token), 0o600); err != nil {
		return fmt.Errorf("write token: %w", err)
	}
	return nil
}

// Args is the command line of n.Bin on this node, extra flags last.
func (n *Node) Args(extra ...string) []string {
	o := n.opts
	args := []string{n.Bin, "--node-name", n.NodeName,
		"--bpffs-dir", n.BPFFSDir, "--cgroup-root", n.CgroupRoot, "--node-netns", simnode.NetnsPath(n.NodeNS),
		"--zds-socket", n.ZDS, "--cni-socket", n.CNI, "--inspect-socket", n.Inspect}
	if k := o.Kube; k != nil {
		pluginServer := k.PluginServer
		if pluginServer == "" {
			pluginServer = k.Server
		}
		args = append(args, "--kubeconfig", filepath.Join(n.Dir, "kubeconfig"),
			"--token-path", filepath.Join(n.Dir, "token"), "--ca-path", filepath.Join(n.Dir, "ca.crt"), "--api-server", pluginServer,
			"--daemonset-namespace", k.DaemonSetNamespace, "--daemonset-name", k.DaemonSetName)
	} else {
		args = append(args, "--standalone-pods", n.PodFile)
	}
	if o.InstallCNI {
		args = append(args, "--cni-bin-dir", n.CNIBinDir, "--cni-conf-dir", n.CNIConfDir, "--cni-plugin-binary", n.Plugin,
			"--cni-owned-conflist="+o.OwnedConflist)
	} else {
		args = append(args, "--install-cni=false")
	}
	for _, f := range []struct{ flag, v string }{
		{"--health-addr", o.HealthAddr}, {"--metrics-addr", o.MetricsAddr}, {"--log-level", o.LogLevel},
	} {
		if f.v != "" {
			args = append(args, f.flag, f.v)
		}
	}
	args = slices.DeleteFunc(append(args, extra...), func(a string) bool {
		return slices.ContainsFunc(n.Omit, func(f string) bool { return a == f || strings.HasPrefix(a, f+"=") })
	})
	return args
}

// Release is a release's agent and CNI plugin, built side by side (the
// fallback beside the plugin, where its installer copies it from), and
// the flags of Args it does not know yet.
type Release struct {
	Version       string
	Agent, Plugin string
	Omit          []string
}

// LastRelease builds the last release of hack/releases (once per commit,
// cached in .cache/releases/<commit>/).
func LastRelease(t simnode.TB) Release {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := testbin.Root(wd)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := testbin.Last(root)
	if err != nil {
		t.Fatal(err)
	}
	r := Release{Version: rel.Version}
	// v0.1.0 predates the owned conflist.
	if rel.Version == "v0.1.0" {
		r.Omit = []string{"--cni-owned-conflist"}
	}
	for _, c := range []struct {
		bin string
		to  *string
	}{{agentBinary, &r.Agent}, {pluginBinary, &r.Plugin}, {fallbackBinary, nil}} {
		path, err := testbin.Build(root, rel, module+c.bin)
		if err != nil {
			t.Fatal(err)
		}
		if c.to != nil {
			*c.to = path
		}
	}
	return r
}

// StartAgent starts the agent (through the wrapper, if any) without
// waiting for it; it is ended by PID at t's cleanup.
func (n *Node) StartAgent(t simnode.TB, extra ...string) *simnode.Process {
	t.Helper()
	ns := n.NodeNS
	if n.opts.CallerNetns {
		ns = ""
	}
	n.Started = time.Now()
	n.Agent = simnode.StartProcess(t, ns, n.opts.Cgroup, append(slices.Clone(n.Wrapper), n.Args(extra...)...)...)
	return n.Agent
}

// WaitReady waits until the agent's /readyz answers 200 and returns the
// time since its exec; it fails when the agent exits first or takes more
// than two minutes.
func (n *Node) WaitReady() (time.Duration, error) {
	poll := testenv.Poll
	if every := n.opts.ReadyPoll; every > 0 {
		poll = func(timeout time.Duration, cond func() bool) bool { return testenv.PollEvery(every, timeout, cond) }
	}
	var took time.Duration
	var code int
	poll(readyTimeout, func() bool {
		code, _ = n.Get("/readyz")
		took = time.Since(n.Started)
		return code == http.StatusOK || n.Agent.Exited()
	})
	if code != http.StatusOK {
		return 0, fmt.Errorf("agent not ready (/readyz %d); its output:\n%s", code, n.Agent.Output.String())
	}
	return took, nil
}

// CheckSockets dials the agent's ZDS, CNI and inspection sockets.
func (n *Node) CheckSockets() error {
	for _, s := range []struct{ network, path string }{
		{"unixpacket", n.ZDS}, {"unix", n.CNI}, {"unix", n.Inspect},
	} {
		c, err := net.Dial(s.network, s.path)
		if err != nil {
			return fmt.Errorf("agent ready but %s does not answer: %w", s.path, err)
		}
		_ = c.Close()
	}
	return nil
}

// StartReadyAgent starts the agent and waits until it is ready and every
// socket of it answers.
func (n *Node) StartReadyAgent(t simnode.TB, extra ...string) {
	t.Helper()
	n.StartAgent(t, extra...)
	if _, err := n.WaitReady(); err != nil {
		t.Fatal(err)
	}
	if err := n.CheckSockets(); err != nil {
		t.Fatal(err)
	}
}

// Stop sends the agent SIGTERM, kills it after grace, and says why when
// it did not exit cleanly on its own.
func (n *Node) Stop(grace time.Duration) error {
	if !n.Agent.Terminate(grace) {
		return fmt.Errorf("agent did not stop cleanly; its output:\n%s", n.Agent.Output.String())
	}
	return nil
}

// Get fetches a path from the agent's health server, or its metrics
// server for /metrics; on an error the code is 0 and the body the error.
func (n *Node) Get(path string) (int, string) {
	addr, def := n.opts.HealthAddr, "8000"
	if path == "/metrics" {
		addr, def = n.opts.MetricsAddr, "15014"
	}
	host, port, err := net.SplitHostPort(addr)
	if addr == "" || err != nil {
		host, port = "", def
	}
	if host == "" {
		host = "127.0.0.1"
	}
	code, body, err := simnode.Get(n.http, "http://"+net.JoinHostPort(host, port)+path)
	if err != nil {
		return 0, err.Error()
	}
	return code, body
}

// WaitZtunnel waits until ztunnel (started by the caller) is connected to
// the agent.
func (n *Node) WaitZtunnel(t simnode.TB) {
	t.Helper()
	if !testenv.Poll(time.Minute, func() bool {
		_, body := n.Get("/metrics")
		return strings.Contains(body, "\nztunnel_connected 1\n")
	}) {
		t.Fatalf("timed out after 1m0s waiting: ztunnel connected; the agent's output:\n%s", n.Agent.Output.String())
	}
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
func PinnedPods(t *testing.T, dir string) []inspect.EnrolledPod {
	t.Helper()
	view, err := inspect.OpenPinned(dir)
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

// DNSCapture says, for each pod in the pins (by "namespace/name"), whether
// the data path captures its DNS; nil when the pins cannot be read.
func (n *Node) DNSCapture() map[string]bool {
	view, err := inspect.OpenPinned(n.BPFFSDir)
	if err != nil {
		return nil
	}
	defer view.Close()
	d, err := view.Dump()
	if err != nil {
		return nil
	}
	out := map[string]bool{}
	for _, e := range d.Netns {
		out[e.Pod] = e.Options.DNSCapture
	}
	return out
}
