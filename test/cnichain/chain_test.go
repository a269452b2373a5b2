//go:build linux

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package cnichain invokes a real conflist through libcni, the library
// container runtimes use: bridge + host-local from containernetworking/plugins
// v1.10.0, then ambient-ebpf-cni as chained in by the installer, plus
// loopback, inside a node netns the test creates. A fake agent records what
// the plugin forwards.
package cnichain

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// cniPluginsVersion must match CNI_PLUGINS_VERSION in the Makefile.
const cniPluginsVersion = "v1.10.0"

// recorder is the fake agent: it enrolls every pod it is asked about.
type recorder struct {
	mu   sync.Mutex
	adds []*cniv1.PodAddRequest
	dels []*cniv1.PodDelRequest
}

func (r *recorder) PodAdd(_ context.Context, req *cniv1.PodAddRequest) (events.AddResult, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.adds = append(r.adds, req)
	return events.AddResult{Enrolled: true, Reason: string(enrollment.ReasonNamespaceLabel)}, nil
}

func (r *recorder) PodDel(_ context.Context, req *cniv1.PodDelRequest) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.dels = append(r.dels, req)
	return nil
}

func (r *recorder) snapshot() ([]*cniv1.PodAddRequest, []*cniv1.PodDelRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.adds), slices.Clone(r.dels)
}

func repoRoot(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// referencePlugins returns the directory with the reference plugins, built
// by `make cni-plugins` (CNI_PLUGINS_DIR) or here when missing.
func referencePlugins(t *testing.T, root string) string {
	t.Helper()
	dir := os.Getenv("CNI_PLUGINS_DIR")
	if dir == "" {
		dir = filepath.Join(root, ".cache", "cni-plugins", cniPluginsVersion)
	}
	refPlugins := map[string]string{
		"bridge":     "github.com/containernetworking/plugins/plugins/main/bridge",
		"host-local": "github.com/containernetworking/plugins/plugins/ipam/host-local",
		"loopback":   "github.com/containernetworking/plugins/plugins/main/loopback",
	}
	var missing []string
	for name, pkg := range refPlugins {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			missing = append(missing, pkg+"@"+cniPluginsVersion)
		}
	}
	if len(missing) > 0 {
		cmd := exec.Command("go", append([]string{"install"}, missing...)...)
		cmd.Env = append(os.Environ(), "GOBIN="+dir, "GOFLAGS=-mod=mod", "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("build reference CNI plugins into %s: %v\n%s", dir, err, out)
		}
	}
	return dir
}

func buildPlugin(t *testing.T, root, dir string) {
	t.Helper()
	// The plugin and, beside it as the installer puts it, its fallback.
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/ambient-ebpf-cni", "./cmd/ambient-ebpf-cni-fallback")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build ambient-ebpf-cni: %v\n%s", err, out)
	}
}

// node is a node netns with pod netns next to it. Every CNI call runs on a
// locked OS thread switched into the node netns, so the plugins the runtime
// execs inherit it and the machine's root netns is never touched.
type node struct {
	t    *testing.T
	id   string
	orig netns.NsHandle
	ns   netns.NsHandle
}

// inNS runs f on a locked OS thread inside ns, and always switches back.
func (n *node) inNS(ns netns.NsHandle, f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := netns.Set(ns); err != nil {
		return fmt.Errorf("enter netns: %w", err)
	}
	defer func() {
		if err := netns.Set(n.orig); err != nil {
			panic(fmt.Sprintf("cannot return to the test's netns: %v", err))
		}
	}()
	return f()
}

// newNamedNS creates a named netns and returns to the test's netns.
func newNamedNS(t *testing.T, orig netns.NsHandle, name string) netns.NsHandle {
	t.Helper()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	h, err := netns.NewNamed(name)
	if errSet := netns.Set(orig); errSet != nil {
		panic(fmt.Sprintf("cannot return to the test's netns: %v", errSet))
	}
	if err != nil {
		t.Fatalf("create netns %s: %v", name, err)
	}
	t.Cleanup(func() {
		_ = h.Close()
		if err := netns.DeleteNamed(name); err != nil {
			t.Errorf("delete netns %s: %v", name, err)
		}
	})
	return h
}

func newNode(t *testing.T) *node {
	t.Helper()
	orig, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = orig.Close() })
	n := &node{t: t, id: testenv.RunID(), orig: orig}
	n.ns = newNamedNS(t, orig, "aeb-node-"+n.id)
	return n
}

// pod creates a pod netns and returns its path.
func (n *node) pod(name string) (string, netns.NsHandle) {
	nsName := "aeb-" + name + "-" + n.id
	h := newNamedNS(n.t, n.orig, nsName)
	return "/var/run/netns/" + nsName, h
}

func rt(id, nsPath, namespace, name string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: id, NetNS: nsPath, IfName: "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", namespace}, {"K8S_POD_NAME", name},
			{"K8S_POD_INFRA_CONTAINER_ID", id}, {"K8S_POD_UID", "uid-" + name},
		},
	}
}

const podFile = `apiVersion: v1
kind: Namespace
metadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}
---
apiVersion: v1
kind: Namespace
metadata: {name: plain}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: mesh, uid: uid-web}
---
apiVersion: v1
kind: Pod
metadata: {name: late, namespace: mesh, uid: uid-late}
---
apiVersion: v1
kind: Pod
metadata: {name: app, namespace: plain, uid: uid-app}
`

// env is what a chain test runs on: the plugin built into tmp/build, the
// reference plugins, the pod file, a fake agent on its socket, a node netns
// and the libcni runtime that execs plugins from binDir then the
// reference directory.
type env struct {
	tmp, binDir, podFile, sock, ipamDir string
	agent                               *recorder
	stopAgent                           func()
	n                                   *node
	cni                                 *libcni.CNIConfig
}

func newEnv(t *testing.T) *env {
	t.Helper()
	testenv.RequireRoot(t)
	root := repoRoot(t)
	refDir := referencePlugins(t, root)
	tmp := t.TempDir()
	e := &env{tmp: tmp, binDir: filepath.Join(tmp, "bin"), podFile: filepath.Join(tmp, "pods.yaml"),
		sock: filepath.Join(tmp, "agent", "cni.sock"), ipamDir: filepath.Join(tmp, "host-local"), agent: &recorder{}}
	buildPlugin(t, root, filepath.Join(tmp, "build"))
	if err := os.WriteFile(e.podFile, []byte(podFile), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(e.binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	e.stopAgent = serveAgent(t, e.sock, e.agent)
	e.n = newNode(t)
	e.cni = libcni.NewCNIConfigWithCacheDir([]string{e.binDir, refDir}, filepath.Join(tmp, "cache"), nil)
	return e
}

func TestConflistThroughLibcni(t *testing.T) {
	e := newEnv(t)
	tmp, binDir, sock, podFilePath, ipamDir := e.tmp, e.binDir, e.sock, e.podFile, e.ipamDir
	agent, stopAgent, n, cni := e.agent, e.stopAgent, e.n, e.cni
	list := installChain(t, tmp, n.id, ipamDir, sock, podFilePath, binDir)
	lo, err := libcni.ConfFromBytes([]byte(`{"cniVersion": "1.1.0", "name": "lo", "type": "loopback"}`))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inNode := func(f func() error) error { return n.inNS(n.ns, f) }

	// An ambient pod: addresses from host-local, enrolled through the chain.
	webPath, webNS := n.pod("web")
	web := rt("sandbox-web-"+n.id, webPath, "mesh", "web")
	var res types.Result
	err = inNode(func() error {
		loRT := *web
		loRT.IfName = "lo"
		if _, err := cni.AddNetwork(ctx, lo, &loRT); err != nil {
			return fmt.Errorf("loopback: %w", err)
		}
		res, err = cni.AddNetworkList(ctx, list, web)
		return err
	})
	if err != nil {
		t.Fatalf("ADD web: %v", err)
	}
	webIPs := resultIPs(t, res)
	if len(webIPs) != 2 || !strings.HasPrefix(webIPs[0], "198.18.7.") || !strings.HasPrefix(webIPs[1], "fd00:198:18:7:") {
		t.Fatalf("web got %v, want one address from each host-local range", webIPs)
	}
	assertPodHasAddress(t, webNS, "eth0", webIPs[0])
	adds, _ := agent.snapshot()
	if len(adds) != 1 {
		t.Fatalf("agent saw %d adds, want 1", len(adds))
	}
	want := &cniv1.Pod{Name: "web", Namespace: "mesh", Uid: "uid-web", ContainerId: web.ContainerID, Netns: webPath, Interface: "eth0"}
	if adds[0].GetPod().String() != want.String() || !slices.Equal(adds[0].GetIps(), webIPs) {
		t.Errorf("agent saw %v, want pod %v with ips %v", adds[0], want, webIPs)
	}

	// CHECK and STATUS answer success while everything is in place.
	if err := inNode(func() error { return cni.CheckNetworkList(ctx, list, web) }); err != nil {
		t.Errorf("CHECK web: %v", err)
	}
	if err := inNode(func() error { return cni.GetStatusNetworkList(ctx, list) }); err != nil {
		t.Errorf("STATUS with the agent up: %v", err)
	}

	// DEL reaches the agent and releases the address.
	if err := inNode(func() error { return cni.DelNetworkList(ctx, list, web) }); err != nil {
		t.Fatalf("DEL web: %v", err)
	}
	if _, dels := agent.snapshot(); len(dels) != 1 || dels[0].GetPod().GetUid() != "uid-web" {
		t.Errorf("agent dels = %v, want web's", dels)
	}
	assertLease(t, ipamDir, webIPs[0], false)

	// With the agent stopped: an ambient pod fails closed, a plain one starts.
	stopAgent()
	latePath, _ := n.pod("late")
	late := rt("sandbox-late-"+n.id, latePath, "mesh", "late")
	err = inNode(func() error { _, err := cni.AddNetworkList(ctx, list, late); return err })
	if err == nil || !strings.Contains(err.Error(), "agent unreachable") || !strings.Contains(err.Error(), "mesh/late") ||
		!strings.Contains(err.Error(), "ambient") {
		t.Errorf("ADD of an ambient pod with the agent down = %v, want a fail-closed error naming the pod", err)
	}
	// The runtime cleans up a failed ADD with DEL, which must succeed with the agent down.
	if err := inNode(func() error { return cni.DelNetworkList(ctx, list, late) }); err != nil {
		t.Errorf("DEL with the agent down: %v", err)
	}

	appPath, appNS := n.pod("app")
	app := rt("sandbox-app-"+n.id, appPath, "plain", "app")
	err = inNode(func() error { res, err = cni.AddNetworkList(ctx, list, app); return err })
	if err != nil {
		t.Fatalf("ADD of a plain pod with the agent down: %v", err)
	}
	appIPs := resultIPs(t, res)
	assertPodHasAddress(t, appNS, "eth0", appIPs[0])
	if err := inNode(func() error { return cni.GetStatusNetworkList(ctx, list) }); err != nil {
		t.Errorf("STATUS with the agent down and a pod-file fallback: %v", err)
	}

	// GC keeps valid attachments (app's lease stays) and answers success.
	err = inNode(func() error {
		return cni.GCNetworkList(ctx, list, &libcni.GCArgs{ValidAttachments: []types.GCAttachment{{ContainerID: app.ContainerID, IfName: "eth0"}}})
	})
	if err != nil {
		t.Errorf("GC: %v", err)
	}
	assertLease(t, ipamDir, appIPs[0], true)
	if err := inNode(func() error { return cni.DelNetworkList(ctx, list, app) }); err != nil {
		t.Errorf("DEL app: %v", err)
	}
	if adds, _ := agent.snapshot(); len(adds) != 1 {
		t.Errorf("agent saw %d adds after it stopped, want none", len(adds)-1)
	}
}

// installChain plays the primary CNI (a lone bridge .conf in the conf dir)
// and the agent's installer (which copies the plugin and chains it in), then
// loads the network the way containerd does: the first conf file by name.
func installChain(t *testing.T, tmp, id, ipamDir, sock, podFilePath, binDir string) *libcni.NetworkConfigList {
	t.Helper()
	confDir := filepath.Join(tmp, "net.d")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writePrimary(t, confDir, id, ipamDir, "")
	inst := install.New(install.Config{
		PluginBinary: filepath.Join(tmp, "build", "ambient-ebpf-cni"),
		BinDirs:      []string{binDir},
		ConfDir:      confDir,
		Plugin:       plugin.Settings{AgentSocket: sock, AgentTimeout: "2s", PodFile: podFilePath},
	})
	if err := inst.Install(context.Background()); err != nil {
		t.Fatalf("install the plugin: %v", err)
	}
	t.Cleanup(func() {
		if err := inst.Cleanup(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	files, err := libcni.ConfFiles(confDir, []string{".conf", ".conflist", ".json"})
	if err != nil || len(files) != 1 || filepath.Base(files[0]) != "10-aeb.conflist" {
		t.Fatalf("conf files after install = %v, %v; want the converted 10-aeb.conflist", files, err)
	}
	list, err := libcni.NetworkConfFromFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Plugins) != 2 || list.Plugins[0].Network.Type != "bridge" || list.Plugins[1].Network.Type != "ambient-ebpf-cni" {
		t.Fatalf("installed chain = %s", list.Bytes)
	}
	return list
}

// writePrimary plays the primary CNI writing its lone bridge conf,
// 10-aeb.conf, with extra fields (`, "k": v`) as a rewrite at its start
// may change them.
func writePrimary(t *testing.T, confDir, id, ipamDir, extra string) {
	t.Helper()
	primary := fmt.Sprintf(`{"cniVersion": "1.1.0", "name": "aeb-%[1]s", "type": "bridge", "bridge": "aeb%[1]s",
  "ipam": {"type": "host-local", "dataDir": %[2]q,
           "ranges": [[{"subnet": "198.18.7.0/24"}], [{"subnet": "fd00:198:18:7::/64"}]]}%[3]s}`, id, ipamDir, extra)
	if err := os.MkdirAll(confDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(confDir, "10-aeb.conf"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
}

func serveAgent(t *testing.T, sock string, h events.Handler) (stop func()) {
	t.Helper()
	ln, err := events.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- events.ServeListener(ctx, ln, h) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-errc; err != nil {
				t.Errorf("agent: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func resultIPs(t *testing.T, res types.Result) []string {
	t.Helper()
	r, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	var ips []string
	for _, ip := range r.IPs {
		ips = append(ips, ip.Address.IP.String())
	}
	return ips
}

func assertPodHasAddress(t *testing.T, ns netns.NsHandle, ifName, ip string) {
	t.Helper()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	link, err := h.LinkByName(ifName)
	if err != nil {
		t.Fatalf("pod interface %s: %v", ifName, err)
	}
	addrs, err := h.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if a.IP.Equal(net.ParseIP(ip)) {
			return
		}
	}
	t.Errorf("pod interface %s has %v, want %s", ifName, addrs, ip)
}

// assertLease checks host-local's reservation file for ip.
func assertLease(t *testing.T, dataDir, ip string, want bool) {
	t.Helper()
	matches, err := filepath.Glob(filepath.Join(dataDir, "*", ip))
	if err != nil {
		t.Fatal(err)
	}
	if got := len(matches) > 0; got != want {
		t.Errorf("host-local lease for %s present = %v, want %v", ip, got, want)
	}
}

// TestBinaryAnswersEveryInputWithACNIResult runs the built binary the way a
// runtime does (environment + stdin) and checks that malformed input gets a
// CNI error object on stdout with the spec's code and a non-zero exit.
func TestBinaryAnswersEveryInputWithACNIResult(t *testing.T) {
	root := repoRoot(t)
	dir := t.TempDir()
	buildPlugin(t, root, dir)
	bin := filepath.Join(dir, "ambient-ebpf-cni")
	run := func(command, stdin string) (string, error) {
		cmd := exec.Command(bin)
		cmd.Env = []string{"CNI_COMMAND=" + command, "CNI_CONTAINERID=c1", "CNI_NETNS=/proc/self/ns/net", "CNI_IFNAME=eth0",
			"CNI_PATH=" + dir, "CNI_ARGS=K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=web"}
		cmd.Stdin = strings.NewReader(stdin)
		out, err := cmd.Output()
		return string(out), err
	}
	out, err := run("VERSION", `{"cniVersion":"1.1.0"}`)
	if err != nil {
		t.Fatalf("VERSION: %v", err)
	}
	var vi struct {
		Supported []string `json:"supportedVersions"`
	}
	if err := json.Unmarshal([]byte(out), &vi); err != nil || !slices.Equal(vi.Supported, []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"}) {
		t.Errorf("VERSION = %s (%v)", out, err)
	}
	cases := []struct {
		name, command, stdin string
		code                 uint
	}{
		{"bad json", "ADD", `{"cniVersion":`, types.ErrDecodingFailure},
		{"unknown cniVersion", "ADD", `{"cniVersion":"7.0.0","name":"k8s","type":"ambient-ebpf-cni"}`, types.ErrIncompatibleCNIVersion},
		{"missing prevResult", "ADD", `{"cniVersion":"1.0.0","name":"k8s","type":"ambient-ebpf-cni"}`, types.ErrInvalidNetworkConfig},
		{"bad prevResult", "ADD", `{"cniVersion":"1.0.0","name":"k8s","type":"ambient-ebpf-cni","prevResult":{"ips":[{"address":"x"}]}}`, types.ErrDecodingFailure},
		{"bad json on DEL", "DEL", `nope`, types.ErrDecodingFailure},
		{"STATUS before 1.1", "STATUS", `{"cniVersion":"1.0.0","name":"k8s","type":"ambient-ebpf-cni"}`, types.ErrIncompatibleCNIVersion},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := run(tc.command, tc.stdin)
			var exitErr *exec.ExitError
			if !errors.As(err, &exitErr) {
				t.Fatalf("%s exited with %v, want a non-zero exit; stdout %s", tc.command, err, out)
			}
			var cniErr types.Error
			if err := json.Unmarshal([]byte(out), &cniErr); err != nil || cniErr.Code != tc.code || cniErr.Msg == "" {
				t.Errorf("stdout = %s, want a CNI error with code %d", out, tc.code)
			}
		})
	}
}
