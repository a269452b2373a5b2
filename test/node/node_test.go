// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// repoRoot is the module root, seen from this package's directory.
const repoRoot = "../.."

var (
	images     *Archives
	imagesErr  error
	cluster    *kubeapi.Cluster
	clusterErr error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "hn-images-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	start := time.Now()
	images, imagesErr = BuildImages(repoRoot, dir)
	fmt.Fprintf(os.Stderr, "node: images built in %s\n", time.Since(start).Round(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cluster, clusterErr = kubeapi.Start(ctx)
	cancel()
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

func cniPlugins() string {
	if d := os.Getenv("CNI_PLUGINS_DIR"); d != "" {
		return d
	}
	return filepath.Join(repoRoot, ".cache", "cni-plugins", "v1.10.0")
}

// The stand-in's DNS table: names under knownSuffix are answered by it.
const knownSuffix = "known.test"

var knownAnswer = netip.MustParseAddr("198.18.250.1")

// scene is the node with the agent deployed from the chart, the API server
// the agent watches, and the ztunnel stand-in it hands pods to.
type scene struct {
	t *testing.T // the running step's (run)
	// root is the test's: what outlives a step (ztunnel) is ended at its
	// cleanup.
	root     *testing.T
	n        *Node
	nodeName string
	api      netip.AddrPort // the API server as the node reaches it
	saDir    string
	agent    *Pod
	agentLog int // log lines of earlier agent containers
	zt       *ztunnel
	// ztCgroup is the stand-in's cgroup: the node's subtree, or a pod's
	// cgroup below kubelet's kubepods once kubelet runs, as a ztunnel pod.
	ztCgroup  string
	ambientNS string
	plainNS   string
}

// ztunnel is the stand-in process: in the node's cgroup subtree, as a
// ztunnel pod is (the socket hooks file its listeners and answer its
// SO_ORIGINAL_DST there), connected to the agent container's ZDS socket.
type ztunnel struct {
	proc *simnode.Process
	// records are the record files of this and earlier processes (one
	// each, after a reboot).
	records []string
}

// all returns the connections it handled, earlier processes' included.
func (z *ztunnel) all() []standin.Record {
	var out []standin.Record
	for _, f := range z.records {
		b, _ := os.ReadFile(f)
		for _, l := range strings.Split(string(b), "\n") {
			var rec standin.Record
			if json.Unmarshal([]byte(l), &rec) == nil {
				out = append(out, rec)
			}
		}
	}
	return out
}

// has reports whether ztunnel holds the pod now (its last event for the
// pod is an add), from its log.
func (z *ztunnel) has(uid string) bool {
	has := false
	for _, l := range strings.Split(z.proc.Output.String(), "\n") {
		switch {
		case !strings.Contains(l, "uid="+uid):
		case strings.Contains(l, "pod added"):
			has = true
		case strings.Contains(l, "pod removed"):
			has = false
		}
	}
	return has
}

func newScene(t *testing.T) *scene {
	t.Helper()
	if imagesErr != nil {
		t.Fatalf("build images: %v", imagesErr)
	}
	c := kubeapi.Require(t, cluster, clusterErr)
	n := New(t, Config{CNIPlugins: cniPlugins(), Images: images.All()})
	s := &scene{t: t, root: t, n: n, nodeName: "node-" + n.ID}
	s.api = n.Forward(strings.TrimPrefix(c.Config.Host, "https://"))

	ctx := context.Background()
	c.EnsureNamespace(t, ReleaseNamespace)
	s.ambientNS = c.Namespace(t, "ambient", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}).Name
	s.plainNS = c.Namespace(t, "plain", nil).Name
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: s.nodeName}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Client.CoreV1().Nodes().Delete(context.Background(), s.nodeName, metav1.DeleteOptions{}) })

	s.zt = &ztunnel{}
	s.startZtunnel()
	return s
}

// startZtunnel starts the stand-in (again, after a reboot, with a record
// file of its own): it receives pods from the agent container over ZDS.
func (s *scene) startZtunnel() {
	cg := s.ztCgroup
	if cg == "" {
		cg = filepath.Join(s.n.Cgroup2, "ztunnel")
	}
	if err := os.MkdirAll(cg, 0o755); err != nil {
		s.t.Fatal(err)
	}
	records := filepath.Join(s.n.Dir, fmt.Sprintf("ztunnel-records-%d.jsonl", len(s.zt.records)))
	s.zt.records = append(s.zt.records, records)
	s.zt.proc = simnode.StartProcess(s.root, "", cg, images.Ztunnel, "--zds-socket", filepath.Join(s.n.ZtunnelSocketDir(), "ztunnel.sock"),
		"--records", records, "--dns", "*."+knownSuffix+"="+knownAnswer.String())
}

// deploy renders the chart with extra values, applies its objects to the
// API server, and (re)starts the agent container from the DaemonSet's pod
// template in the agent's sandbox. It returns the container id and waits
// for /readyz unless wait is false.
func (s *scene) deploy(extraValues string, wait bool) (string, error) {
	t := s.t
	t.Helper()
	ch, err := RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), s.n.ChartValues(extraValues))
	if err != nil {
		t.Fatal(err)
	}
	for _, obj := range ch.Objects {
		cluster.Apply(t, ReleaseNamespace, obj)
	}
	if s.saDir == "" {
		s.saDir = s.serviceAccount(ch.DaemonSet.Spec.Template.Spec.ServiceAccountName)
	}
	pc := PodContext{
		PodSpec:           PodSpec{Name: ch.DaemonSet.Name + "-" + s.n.ID, Namespace: ReleaseNamespace, UID: "a9e00000-0000-4000-8000-" + s.n.ID + "0000"},
		NodeName:          s.nodeName,
		HostIP:            "127.0.0.1",
		ServiceAccountDir: s.saDir,
		Env:               map[string]string{"KUBERNETES_SERVICE_HOST": s.api.Addr().String(), "KUBERNETES_SERVICE_PORT": fmt.Sprint(s.api.Port())},
	}
	sb, cc, err := s.n.FromDaemonSet(ch.DaemonSet, pc)
	if err != nil {
		t.Fatalf("translate the chart's DaemonSet: %v", err)
	}
	if s.agent == nil {
		if s.agent, err = s.n.RunSandbox(pc.PodSpec, sb); err != nil {
			t.Fatalf("agent sandbox: %v", err)
		}
		if sb.Linux.SecurityContext.NamespaceOptions.Network != 2 { // NODE
			t.Fatal("the chart's agent pod is not host network")
		}
	}
	if _, ok := s.agent.Containers[cc.Metadata.Name]; ok {
		s.agentLog += len(s.n.Log(s.agent, cc.Metadata.Name))
		s.n.KillContainer(s.agent, cc.Metadata.Name, 0)
	}
	id, err := s.n.StartContainer(s.agent, cc)
	if err != nil || !wait {
		return id, err
	}
	return id, s.waitReady(id)
}

// waitReady polls the agent's /readyz on the node, as the chart's
// readinessProbe does, and fails when the container exits.
func (s *scene) waitReady(id string) error {
	hc := s.nodeHTTP()
	var exited error
	ready := testenv.Poll(60*time.Second, func() bool {
		if st, code := s.n.ContainerState(id); st == 2 { // EXITED
			exited = fmt.Errorf("agent container exited (%d): %s", code, s.agentLogTail())
			return true
		}
		resp, err := hc.Get("http://127.0.0.1:8000/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK && s.ztunnelConnected(hc)
	})
	switch {
	case exited != nil:
		return exited
	case !ready:
		return fmt.Errorf("agent not ready after 60 s: %s", s.agentLogTail())
	}
	return nil
}

// ztunnelConnected reads the agent's metrics: ztunnel must be connected
// before a CNI ADD of an ambient pod can succeed.
func (s *scene) ztunnelConnected(hc *http.Client) bool {
	resp, err := hc.Get("http://127.0.0.1:15014/metrics")
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return strings.Contains(b.String(), "\nztunnel_connected 1\n")
}

// run runs a step of the suite as a subtest; the scene's helpers fail
// the subtest.
func (s *scene) run(name string, f func(t *testing.T)) bool {
	parent := s.t
	defer func() { s.t = parent }()
	return parent.Run(name, func(t *testing.T) {
		s.t = t
		f(t)
	})
}

func (s *scene) agentLogTail() string {
	lines := s.n.Log(s.agent, "agent")
	if len(lines) > s.agentLog {
		lines = lines[s.agentLog:]
	}
	lines = slices.DeleteFunc(slices.Clone(lines), func(l string) bool { return strings.Contains(l, "drift check") })
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return strings.Join(lines, "\n")
}

// nodeHTTP is an HTTP client whose connections are made in the node netns.
func (s *scene) nodeHTTP() *http.Client {
	ns := s.n.NodeSockets()
	return &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{
		DialContext: func(_ context.Context, _, addr string) (net.Conn, error) {
			ap, err := netip.ParseAddrPort(addr)
			if err != nil {
				return nil, err
			}
			return ns.Dial(ap, sockutil.Opts{}, 2*time.Second)
		},
	}}
}

// serviceAccount writes what kubelet projects into the agent: a token of
// the chart's ServiceAccount (so the chart's RBAC applies), the API
// server's CA and the namespace.
func (s *scene) serviceAccount(name string) string {
	t := s.t
	token := cluster.ServiceAccountToken(t, ReleaseNamespace, name)
	ca, err := cluster.ServingCert()
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(s.n.Dir, "volumes", "serviceaccount")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for f, b := range map[string][]byte{"token": []byte(token), "ca.crt": ca, "namespace": []byte(ReleaseNamespace)} {
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func ptr[T any](v T) *T { return &v }

// app is a pod of the scene: its object in the API server and its sandbox.
type app struct {
	obj *corev1.Pod
	*Pod
}

// pod creates the pod object (bound to the node) and then its sandbox, as
// kubelet would; the error is the runtime's.
func (s *scene) pod(ns, name string) (*app, error) {
	s.t.Helper()
	obj := cluster.Pod(s.t, kubeapi.PodSpec{Namespace: ns, Name: name, Node: s.nodeName})
	p, err := s.n.RunPod(PodSpec{Name: name, Namespace: ns, UID: string(obj.UID)})
	if err != nil {
		return &app{obj: obj}, err
	}
	obj = cluster.SetStatus(s.t, obj, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{p.IP}})
	return &app{obj: obj, Pod: p}, nil
}

// remove deletes the pod object (grace period 0, as kubelet finishes a
// deletion) and then its sandbox: the runtime runs the CNI DEL.
func (s *scene) remove(a *app) error {
	err := cluster.Client.CoreV1().Pods(a.obj.Namespace).Delete(context.Background(), a.obj.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete pod %s/%s: %w", a.obj.Namespace, a.obj.Name, err)
	}
	if a.Pod == nil {
		return nil
	}
	return s.n.RemovePod(a.Pod)
}

func (s *scene) mustPod(ns, name string) *app {
	s.t.Helper()
	a, err := s.pod(ns, name)
	if err != nil {
		s.t.Fatalf("pod %s/%s: %v", ns, name, err)
	}
	return a
}

// echo starts the echo server in a pod.
func (s *scene) echo(a *app) {
	s.t.Helper()
	s.n.MustStartContainer(a.Pod, AppContainer("echo", EchoImage, "serve", a.Name, ":8080", ":8081"))
}

// client starts an idle client container in a pod, for execs.
func (s *scene) client(a *app) {
	s.t.Helper()
	s.n.MustStartContainer(a.Pod, AppContainer("client", ClientImage, "pause"))
}

type result struct {
	Reply *struct{ Server, Local, Peer string }
	Local string
	Addrs []string
	Sent  int
	Err   string
}

func (s *scene) dial(from *app, to netip.AddrPort) result {
	s.t.Helper()
	var r result
	s.n.Exec(from.Pod, "client", &r, AppBinary, "dial", to.String())
	if r.Err != "" || r.Reply == nil {
		s.t.Fatalf("%s -> %s: %+v\nztunnel records: %+v", from.Name, to, r, s.zt.all())
	}
	return r
}

// served reports whether the echo server of a logged a connection from
// peer (what the receiving side saw).
func (s *scene) served(a *app, peer string) bool {
	for _, l := range s.n.Log(a.Pod, "echo") {
		var r struct{ Peer string }
		if json.Unmarshal([]byte(l), &r) == nil && r.Peer == peer {
			return true
		}
	}
	return false
}

func (s *scene) record(listener int, peerOrDst func(standin.Record) bool) (standin.Record, bool) {
	for _, r := range s.zt.all() {
		if r.Listener == listener && peerOrDst(r) {
			return r, true
		}
	}
	return standin.Record{}, false
}

func redirection(t *testing.T, a *app) string {
	p, err := cluster.Client.CoreV1().Pods(a.obj.Namespace).Get(context.Background(), a.obj.Name, metav1.GetOptions{})
	if err != nil {
		return "<" + err.Error() + ">"
	}
	return p.Annotations[enrollment.RedirectionAnnotation]
}

// TestNode runs the agent from the project's image, with the chart's
// privileges, on a containerd + runc node; its steps share the node and run
// in order.
func TestNode(t *testing.T) {
	s := newScene(t)
	if _, err := s.deploy("", true); err != nil {
		t.Fatal(err)
	}

	// The agent installed the plugin into the runtime's CNI directories.
	conf, err := os.ReadFile(filepath.Join(s.n.CNIConf, "10-ptp.conflist"))
	if err != nil || !strings.Contains(string(conf), `"ambient-ebpf-cni"`) {
		t.Fatalf("the agent did not chain the plugin into the primary conflist: %v\n%s", err, conf)
	}
	if _, err := os.Stat(filepath.Join(s.n.CNIBin, "ambient-ebpf-cni")); err != nil {
		t.Fatalf("plugin binary not installed: %v", err)
	}

	var server, client, plainServer, plainClient *app
	s.run("enrolled before the app starts", func(t *testing.T) {
		server = s.mustPod(s.ambientNS, "server")
		client = s.mustPod(s.ambientNS, "client")
		// The sandbox exists, no container runs yet: ztunnel has the pods.
		for _, a := range []*app{server, client} {
			if !s.zt.has(string(a.obj.UID)) {
				t.Fatalf("pod %s: sandbox ready but ztunnel does not have it ", a.Name)
			}
		}
		s.echo(server)
		s.client(client)
		testenv.Eventually(t, 30*time.Second, "redirection annotation", func() bool { return redirection(t, server) == "enabled" })
		plainServer = s.mustPod(s.plainNS, "server")
		plainClient = s.mustPod(s.plainNS, "client")
		s.echo(plainServer)
		s.client(plainClient)
		if s.zt.has(string(plainServer.obj.UID)) || s.zt.has(string(plainClient.obj.UID)) {
			t.Fatal("a pod outside the mesh was handed to ztunnel")
		}
	})
	if server == nil || plainClient == nil {
		t.FailNow()
	}

	s.run("outbound", func(t *testing.T) {
		dst := netip.AddrPortFrom(plainServer.IP, 8080)
		r := s.dial(client, dst)
		if _, ok := s.record(standin.OutboundPort, func(rec standin.Record) bool { return rec.OrigDst == dst && rec.Peer.Addr() == client.IP }); !ok {
			t.Fatalf("outbound connection to %s did not reach ztunnel's :15001: %+v", dst, s.zt.all())
		}
		// The receiving side: the server got it from ztunnel's relay in
		// the client's netns, which keeps the client's address.
		if r.Reply.Server != "server" || !strings.HasPrefix(r.Reply.Peer, client.IP.String()+":") {
			t.Fatalf("reply %+v", r.Reply)
		}
		if !s.served(plainServer, r.Reply.Peer) {
			t.Fatalf("the server did not log %s", r.Reply.Peer)
		}
	})

	s.run("inbound", func(t *testing.T) {
		dst := netip.AddrPortFrom(server.IP, 8080)
		r := s.dial(plainClient, dst)
		if _, ok := s.record(standin.InboundPort, func(rec standin.Record) bool { return rec.OrigDst == dst && rec.Peer.Addr() == plainClient.IP }); !ok {
			t.Fatalf("inbound connection to %s did not reach ztunnel's :15006: %+v", dst, s.zt.all())
		}
		if !strings.HasPrefix(r.Reply.Peer, plainClient.IP.String()+":") || !s.served(server, r.Reply.Peer) {
			t.Fatalf("server saw %+v, want the client %s", r.Reply, plainClient.IP)
		}
	})

	s.run("DNS", func(t *testing.T) {
		var r result
		s.n.Exec(client.Pod, "client", &r, AppBinary, "dns", "web."+knownSuffix, "198.18.0.1:53")
		if r.Err != "" || !slices.Equal(r.Addrs, []string{knownAnswer.String()}) {
			t.Fatalf("DNS from an ambient pod: %+v, want ztunnel's answer %s", r, knownAnswer)
		}
		if _, ok := s.record(15053, func(rec standin.Record) bool { return rec.DNSName == "web."+knownSuffix+"." }); !ok {
			t.Fatalf("no DNS record at ztunnel: %+v", s.zt.all())
		}
	})

	s.run("outside the mesh untouched", func(t *testing.T) {
		before := len(s.zt.all())
		dst := netip.AddrPortFrom(plainServer.IP, 8080)
		r := s.dial(plainClient, dst)
		if r.Reply.Peer != r.Local || !s.served(plainServer, r.Local) {
			t.Fatalf("direct connection: client %s, server saw %s", r.Local, r.Reply.Peer)
		}
		if n := len(s.zt.all()); n != before {
			t.Fatalf("ztunnel handled %d connections between pods outside the mesh", n-before)
		}
	})

	s.run("removal", func(t *testing.T) {
		gone := s.mustPod(s.ambientNS, "gone")
		uid := string(gone.obj.UID)
		listed := func() bool {
			var pods []map[string]any
			s.cli(&pods, "pods") // the CLI of the image, reading the pins
			return slices.ContainsFunc(pods, func(p map[string]any) bool { return p["uid"] == uid })
		}
		if !s.zt.has(uid) || !listed() {
			t.Fatal("not enrolled")
		}
		if err := s.remove(gone); err != nil {
			t.Fatal(err)
		}
		if s.zt.has(uid) {
			t.Fatal("ztunnel still has the pod after the runtime removed it")
		}
		if listed() {
			t.Fatal("the pinned state still holds the removed pod")
		}
	})

	s.run("agent restart keeps redirected connections", func(t *testing.T) {
		holder := s.mustPod(s.ambientNS, "holder")
		s.n.MustStartContainer(holder.Pod, AppContainer("hold", ClientImage, "hold", netip.AddrPortFrom(plainServer.IP, 8080).String()))
		testenv.Eventually(t, 30*time.Second, "held connection", func() bool { return len(s.n.Log(holder.Pod, "hold")) > 0 })
		id, err := s.deploy("", true) // kill (SIGKILL) and start again
		if err != nil {
			t.Fatal(err)
		}
		_ = id
		time.Sleep(time.Second) // round trips over the new agent
		after := s.mustPod(s.ambientNS, "after")
		if !s.zt.has(string(after.obj.UID)) {
			t.Fatal("a pod made after the restart is not enrolled")
		}
		s.n.KillContainer(holder.Pod, "hold", 10*time.Second)
		lines := s.n.Log(holder.Pod, "hold")
		var res result
		if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Err != "" || res.Sent == 0 {
			t.Fatalf("held connection across the restart: %s (%v)", lines[len(lines)-1], err)
		}
		t.Logf("held connection: %d round trips, none lost", res.Sent)
	})

	s.run("running pod redirected in place", func(t *testing.T) {
		if err := s.repairs("repaired"); err != nil {
			t.Fatal(err)
		}
	})

	s.run("capabilities", func(t *testing.T) {
		ch, err := RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), s.n.ChartValues(""))
		if err != nil {
			t.Fatal(err)
		}
		granted := ch.DaemonSet.Spec.Template.Spec.Containers[0].SecurityContext.Capabilities.Add
		if len(granted) == 0 {
			t.Fatal("the chart grants no capability")
		}
		for i, c := range granted {
			var rest []string
			for j, o := range granted {
				if j != i {
					rest = append(rest, fmt.Sprintf("%q", o))
				}
			}
			values := fmt.Sprintf("securityContext: {capabilities: [%s]}\n", strings.Join(rest, ", "))
			err := s.worksWith(values, fmt.Sprintf("no-%s", strings.ToLower(strings.ReplaceAll(string(c), "_", ""))))
			if err == nil {
				t.Errorf("the chart grants %s, and the agent did all it does without it", c)
				continue
			}
			t.Logf("without %s: %s", c, firstLines(err.Error()))
		}
		// The chart's own set does it all again.
		if _, err := s.deploy("", true); err != nil {
			t.Fatal(err)
		}
		if err := s.repairs("caps-back"); err != nil {
			t.Fatal(err)
		}
	})

	s.run("fail closed", func(t *testing.T) {
		s.n.KillContainer(s.agent, "agent", 0)
		_, err := s.pod(s.ambientNS, "closed")
		if err == nil || !strings.Contains(err.Error(), "ambient-ebpf fails closed") || !strings.Contains(err.Error(), s.ambientNS+"/closed not started") {
			t.Fatalf("ambient sandbox without the agent: %v, want the plugin's fail-closed error", err)
		}
		t.Logf("the runtime reports: %v", err)
		plain := s.mustPod(s.plainNS, "open")
		s.echo(plain)
		if _, err := s.deploy("", true); err != nil {
			t.Fatal(err)
		}
	})
}

// worksWith deploys the agent with extra chart values and returns the
// first thing it could not do: start and get ready, enrol a new ambient
// pod (the runtime's CNI ADD), redirect a running pod in place.
func (s *scene) worksWith(values, name string) error {
	s.t.Helper()
	id, err := s.deploy(values, false)
	if err != nil {
		return fmt.Errorf("container: %w", err)
	}
	if err := s.waitReady(id); err != nil {
		return fmt.Errorf("start: %w", err)
	}
	a, err := s.pod(s.ambientNS, name)
	if err != nil {
		return fmt.Errorf("new ambient pod: %w", err)
	}
	if err := s.remove(a); err != nil {
		s.t.Fatal(err)
	}
	return s.repairs(name + "-running")
}

// repairs starts a pod outside the mesh (its app as uid 1000, its pause
// process as the image's uid), labels it ambient and waits for the agent to
// redirect it in place: the agent finds its netns through /proc.
func (s *scene) repairs(name string) error {
	s.t.Helper()
	a := s.mustPod(s.plainNS, name)
	s.echo(a)
	body := []byte(`{"metadata":{"labels":{"` + enrollment.DataplaneModeLabel + `":"` + enrollment.DataplaneModeAmbient + `"}}}`)
	if _, err := cluster.Client.CoreV1().Pods(a.obj.Namespace).Patch(context.Background(), a.obj.Name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		s.t.Fatal(err)
	}
	defer func() {
		if err := s.remove(a); err != nil {
			s.t.Error(err)
		}
	}()
	if testenv.Poll(15*time.Second, func() bool { return s.zt.has(string(a.obj.UID)) && redirection(s.t, a) == "enabled" }) {
		return nil
	}
	return fmt.Errorf("running pod labelled ambient not redirected in place (annotation %q); agent log ends:\n%s", redirection(s.t, a), s.agentLogTail())
}

// firstLines keeps an error's first line and the agent's last error or
// warning.
func firstLines(s string) string {
	lines := strings.Split(s, "\n")
	out := lines[0]
	for i := len(lines) - 1; i > 0; i-- {
		if strings.Contains(lines[i], "level=ERROR") || strings.Contains(lines[i], "level=WARN") {
			return out + "\n" + strings.TrimSpace(lines[i])
		}
	}
	return out
}

// cli runs the ambient-ebpf CLI of the project's image in the agent's
// container and decodes its JSON output.
func (s *scene) cli(v any, args ...string) {
	s.t.Helper()
	s.n.Exec(s.agent, "agent", v, append([]string{"/usr/local/bin/ambient-ebpf", "-o", "json", "--bpffs=" + filepath.Join(s.n.BPFFS, "ambient-ebpf"),
		"--inspect-socket=" + filepath.Join(s.n.Dir, "ambient-ebpf", "inspect.sock")}, args...)...)
}
