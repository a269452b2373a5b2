//go:build linux

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cnichain

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

const ownedName = "00-ambient-ebpf.conflist"

// selectConf loads the network a runtime would from dir: the first file by
// name that parses (a lone conf as a one-plugin list), as libcni and CRI-O
// do.
func selectConf(t *testing.T, dir string) (string, *libcni.NetworkConfigList) {
	t.Helper()
	files, err := libcni.ConfFiles(dir, []string{".conf", ".conflist", ".json"})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(files)
	for _, f := range files {
		var list *libcni.NetworkConfigList
		if strings.HasSuffix(f, ".conflist") {
			list, err = libcni.ConfListFromFile(f)
		} else {
			var c *libcni.NetworkConfig
			if c, err = libcni.ConfFromFile(f); err == nil {
				list, err = libcni.ConfListFromConf(c)
			}
		}
		if err == nil {
			return filepath.Base(f), list
		}
	}
	t.Fatalf("no conf file in %s parses: %v", dir, files)
	return "", nil
}

func chain(list *libcni.NetworkConfigList) []string {
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
}

// A node reboots without drain: the primary CNI rewrites its conf at start
// without our entry, before the agent runs. The owned conflist the installer
// wrote before the reboot is still what the runtime selects, so a pod ADD
// runs the real plugin binary: the agent enrolls the pod while it is up,
// and with the agent unreachable an ambient pod's ADD fails closed. The
// agent's next pass re-syncs the copy from the rewritten primary; uninstall
// hands the directory back to the primary's own file.
func TestOwnedConflistThroughLibcni(t *testing.T) {
	e := newEnv(t)
	n, agent, confDir := e.n, e.agent, filepath.Join(e.tmp, "net.d")
	writePrimary(t, confDir, n.id, e.ipamDir, "")
	inst := install.New(install.Config{
		PluginBinary:  filepath.Join(e.tmp, "build", "ambient-ebpf-cni"),
		BinDirs:       []string{e.binDir},
		ConfDir:       confDir,
		OwnedConflist: ownedName,
		Plugin:        plugin.Settings{AgentSocket: e.sock, AgentTimeout: "2s", PodFile: e.podFile},
	})
	if err := inst.Install(context.Background()); err != nil {
		t.Fatalf("install the plugin: %v", err)
	}
	t.Cleanup(func() {
		if err := inst.Cleanup(); err != nil {
			t.Errorf("uninstall: %v", err)
		}
	})
	cni := e.cni
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inNode := func(f func() error) error { return n.inNS(n.ns, f) }

	// The reboot: the primary writes its conf again, without us.
	writePrimary(t, confDir, n.id, e.ipamDir, `, "isDefaultGateway": false`)
	name, list := selectConf(t, confDir)
	if name != ownedName || !slices.Equal(chain(list), []string{"bridge", plugin.PluginType}) {
		t.Fatalf("after the primary rewrote its conf the runtime selects %s %v, want %s with our plugin", name, chain(list), ownedName)
	}
	webPath, webNS := n.pod("web")
	web := rt("sandbox-web-"+n.id, webPath, "mesh", "web")
	var res types.Result
	err := inNode(func() error { var err error; res, err = cni.AddNetworkList(ctx, list, web); return err })
	if err != nil {
		t.Fatalf("ADD web: %v", err)
	}
	ips := resultIPs(t, res)
	assertPodHasAddress(t, webNS, "eth0", ips[0])
	if adds, _ := agent.snapshot(); len(adds) != 1 || adds[0].GetPod().GetName() != "web" {
		t.Fatalf("agent saw %v, want web's ADD: our plugin did not run", adds)
	}
	if err := inNode(func() error { return cni.DelNetworkList(ctx, list, web) }); err != nil {
		t.Fatalf("DEL web: %v", err)
	}

	// The agent's pass (its watcher saw the rewrite) re-syncs the copy.
	if err := inst.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	name, list = selectConf(t, confDir)
	if name != ownedName || !strings.Contains(string(list.Bytes), "isDefaultGateway") || !slices.Equal(chain(list), []string{"bridge", plugin.PluginType}) {
		t.Fatalf("after re-sync the runtime selects %s %s", name, list.Bytes)
	}

	// The agent is down (not started yet after the reboot): an ambient pod fails closed.
	e.stopAgent()
	latePath, _ := n.pod("late")
	late := rt("sandbox-late-"+n.id, latePath, "mesh", "late")
	err = inNode(func() error { _, err := cni.AddNetworkList(ctx, list, late); return err })
	if err == nil || !strings.Contains(err.Error(), "agent unreachable") || !strings.Contains(err.Error(), "mesh/late") {
		t.Errorf("ADD of an ambient pod with the agent down = %v, want a fail-closed error naming the pod", err)
	}
	if err := inNode(func() error { return cni.DelNetworkList(ctx, list, late) }); err != nil {
		t.Errorf("DEL with the agent down: %v", err)
	}

	// Uninstall: the primary's own file is selected, nothing names us.
	if err := inst.Cleanup(); err != nil {
		t.Fatal(err)
	}
	writePrimary(t, confDir, n.id, e.ipamDir, "") // the primary starts again later
	name, list = selectConf(t, confDir)
	if name != "10-aeb.conf" || !slices.Equal(chain(list), []string{"bridge"}) {
		t.Errorf("after uninstall the runtime selects %s %v", name, chain(list))
	}
	entries, _ := os.ReadDir(confDir)
	for _, e := range entries {
		if b, _ := os.ReadFile(filepath.Join(confDir, e.Name())); strings.Contains(string(b), plugin.PluginType) {
			t.Errorf("%s still names %s after uninstall", e.Name(), plugin.PluginType)
		}
	}
}

// With the agent unreachable the plugin asks its fallback binary, which reads
// the pod and its namespace from the API server. When either read fails the
// pod's membership cannot be decided (a namespace label alone can make it
// ambient), so the ADD fails closed with CNI error 11 (try again later),
// for a pod in a plain namespace too; only an excluded namespace passes
// without asking. Real plugin and fallback binaries, an API server that
// serves pods but not namespaces, then none at all.
func TestFallbackFailsClosedWhenTheAPICannotBeRead(t *testing.T) {
	root := repoRoot(t)
	dir := t.TempDir()
	buildPlugin(t, root, dir)
	var namespacesUp atomic.Bool
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		ns, name, isPod := strings.Cut(strings.TrimPrefix(r.URL.Path, "/api/v1/namespaces/"), "/pods/")
		switch {
		case isPod:
			fmt.Fprintf(w, `{"apiVersion":"v1","kind":"Pod","metadata":{"name":%q,"namespace":%q,"uid":"uid-%s"}}`, name, ns, name)
		case !namespacesUp.Load():
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprint(w, `{"apiVersion":"v1","kind":"Status","status":"Failure","reason":"ServiceUnavailable","code":503,"message":"etcd is down"}`)
		default:
			fmt.Fprintf(w, `{"apiVersion":"v1","kind":"Namespace","metadata":{"name":%q}}`, ns)
		}
	}))
	defer srv.Close()
	kc := filepath.Join(dir, "kubeconfig")
	ca := base64.StdEncoding.EncodeToString(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}))
	if err := os.WriteFile(kc, []byte("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "+srv.URL+", certificate-authority-data: "+ca+"}}]\n"+
		"users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	stdin, err := json.Marshal(map[string]any{
		"cniVersion": "1.0.0", "name": "k8s", "type": plugin.PluginType, "agentSocket": filepath.Join(dir, "no-agent.sock"),
		"agentTimeout": "1s", "kubeconfig": kc,
		"prevResult": json.RawMessage(`{"cniVersion":"1.0.0","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/p"}],"ips":[{"address":"198.18.7.5/24","interface":0}]}`),
	})
	if err != nil {
		t.Fatal(err)
	}
	add := func(ns, name string) (string, error) {
		cmd := exec.Command(filepath.Join(dir, plugin.PluginType))
		cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=c-" + name, "CNI_NETNS=/var/run/netns/p", "CNI_IFNAME=eth0", "CNI_PATH=" + dir,
			"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=uid-" + name}
		cmd.Stdin = strings.NewReader(string(stdin))
		out, err := cmd.Output()
		return string(out), err
	}
	failsClosed := func(ns, name, want string) {
		t.Helper()
		out, err := add(ns, name)
		var exitErr *exec.ExitError
		var cniErr types.Error
		if !errors.As(err, &exitErr) || json.Unmarshal([]byte(out), &cniErr) != nil || cniErr.Code != types.ErrTryAgainLater ||
			!strings.Contains(cniErr.Msg, ns+"/"+name) || !strings.Contains(cniErr.Msg, want) {
			t.Errorf("ADD %s/%s = %v, %s; want CNI error 11 naming the pod and %q", ns, name, err, out, want)
		}
	}
	passes := func(ns, name string) {
		t.Helper()
		if out, err := add(ns, name); err != nil {
			t.Errorf("ADD %s/%s = %v, %s; want it through", ns, name, err, out)
		}
	}

	// The pod reads, its namespace does not.
	failsClosed("mesh", "web", "read namespace mesh")
	failsClosed("plain", "app", "read namespace plain")
	passes("kube-system", "coredns")
	// Both read: a pod in a plain namespace passes (the fallback works).
	namespacesUp.Store(true)
	passes("plain", "app")
	// No API server at all.
	srv.Close()
	failsClosed("plain", "app", "agent unreachable")
	failsClosed("mesh", "web", "fallback")
}
