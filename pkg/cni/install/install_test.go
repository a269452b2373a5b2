// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package install

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

const (
	bridgeConf = `{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"bridge","bridge":"cni0","ipam":{"type":"host-local","subnet":"198.18.0.0/24"}}`
	listA      = `{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"ptp","ipam":{"type":"host-local","subnet":"198.18.1.0/24"}},{"type":"portmap","capabilities":{"portMappings":true}}],"x-vendor":{"keep":true}}`
	listB      = `{"cniVersion":"0.4.0","name":"b","plugins":[{"type":"bridge"}]}`
	installed  = `{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"ptp"},{"type":"ambient-ebpf-cni","agentSocket":"/old.sock"},{"type":"ambient-ebpf-cni"}]}`
)

type node struct {
	cfg      Config
	confDir  string
	binDirs  []string
	tokenDir string
}

// newNode lays out a fake host in t.TempDir(): a conf dir with files, two
// bin dirs (one holding another plugin), a plugin binary and a token.
func newNode(t *testing.T, files map[string]string) *node {
	t.Helper()
	root := t.TempDir()
	n := &node{confDir: filepath.Join(root, "etc-cni-net.d"), tokenDir: filepath.Join(root, "sa")}
	for _, d := range []string{"opt-cni-bin", "home-kubernetes-bin"} {
		n.binDirs = append(n.binDirs, filepath.Join(root, d))
	}
	for _, d := range append([]string{n.confDir, n.tokenDir}, n.binDirs...) {
		mustWrite(t, filepath.Join(d, ".keep"), "")
		_ = os.Remove(filepath.Join(d, ".keep"))
	}
	for name, content := range files {
		mustWrite(t, filepath.Join(n.confDir, name), content)
	}
	mustWrite(t, filepath.Join(n.binDirs[0], "bridge"), "#!bridge")
	mustWrite(t, filepath.Join(root, "ambient-ebpf-cni"), "#!plugin v1")
	mustWrite(t, filepath.Join(root, fallback.BinaryName), "#!fallback v1")
	mustWrite(t, filepath.Join(n.tokenDir, "token"), "token-1\n")
	mustWrite(t, filepath.Join(n.tokenDir, "ca.crt"), "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
	n.cfg = Config{
		PluginBinary:   filepath.Join(root, "ambient-ebpf-cni"),
		BinDirs:        n.binDirs,
		ConfDir:        n.confDir,
		Plugin:         plugin.Settings{AgentSocket: "/var/run/ambient-ebpf/cni.sock", ExcludeNamespaces: []string{"kube-system"}},
		KubeconfigPath: filepath.Join(n.confDir, "ZZZ-ambient-ebpf-kubeconfig"),
		APIServer:      "https://198.18.0.1:6443",
		TokenPath:      filepath.Join(n.tokenDir, "token"),
		CAPath:         filepath.Join(n.tokenDir, "ca.crt"),
		Debounce:       10 * time.Millisecond,
		Log:            slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	return n
}

func mustWrite(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// snapshot reads every file under dir.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = string(b)
	}
	return out
}

func jsonEqual(a, b string) bool {
	var x, y any
	if json.Unmarshal([]byte(a), &x) != nil || json.Unmarshal([]byte(b), &y) != nil {
		return a == b
	}
	return reflect.DeepEqual(x, y)
}

// pluginTypes lists the plugin types of a conflist file.
func pluginTypes(t *testing.T, content string) []string {
	t.Helper()
	var l struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(content), &l); err != nil {
		t.Fatalf("conflist %q: %v", content, err)
	}
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p["type"].(string))
	}
	return types
}

func TestInstallEachConflistShapeAndUninstall(t *testing.T) {
	cases := []struct {
		name    string
		files   map[string]string
		own     string
		wantErr string
		// target is the file that holds our entry afterwards, with its plugin types.
		target      string
		targetTypes []string
		// untouched files keep their exact bytes.
		untouched []string
		gone      []string
	}{
		{name: "no cni configuration yet", files: map[string]string{}, wantErr: "no cni configuration"},
		{name: "lone conf is converted", files: map[string]string{"10-bridge.conf": bridgeConf},
			target: "10-bridge.conflist", targetTypes: []string{"bridge", PluginType}, gone: []string{"10-bridge.conf"}},
		{name: "lone json conf is converted", files: map[string]string{"10-bridge.json": bridgeConf},
			target: "10-bridge.conflist", targetTypes: []string{"bridge", PluginType}, gone: []string{"10-bridge.json"}},
		{name: "highest-priority conflist of several", files: map[string]string{"20-b.conflist": listB, "10-a.conflist": listA, "99-c.conf": bridgeConf, "README": "x"},
			target: "10-a.conflist", targetTypes: []string{"ptp", "portmap", PluginType}, untouched: []string{"20-b.conflist", "99-c.conf", "README"}},
		{name: "unparsable file is skipped", files: map[string]string{"00-broken.conf": "{", "10-a.conflist": listA},
			target: "10-a.conflist", targetTypes: []string{"ptp", "portmap", PluginType}, untouched: []string{"00-broken.conf"}},
		{name: "already installed entry is updated in place, duplicates dropped", files: map[string]string{"10-a.conflist": installed},
			target: "10-a.conflist", targetTypes: []string{"ptp", PluginType}},
		{name: "own conflist", own: "05-ambient-ebpf.conflist", files: map[string]string{"10-a.conflist": listA},
			target: "05-ambient-ebpf.conflist", targetTypes: []string{PluginType}, untouched: []string{"10-a.conflist"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.files)
			n.cfg.OwnConflist = tc.own
			inst := New(n.cfg)
			err := inst.Install(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Install = %v, want %q", err, tc.wantErr)
				}
				if inst.Ready() {
					t.Error("ready after a failed install")
				}
			} else {
				if err != nil {
					t.Fatalf("Install: %v", err)
				}
				if !inst.Ready() {
					t.Error("not ready after install")
				}
				after := snapshot(t, n.confDir)
				if got := pluginTypes(t, after[tc.target]); !slices.Equal(got, tc.targetTypes) {
					t.Errorf("%s plugins = %v, want %v", tc.target, got, tc.targetTypes)
				}
				assertOurEntry(t, n, after[tc.target])
				for _, f := range tc.untouched {
					if after[f] != tc.files[f] {
						t.Errorf("%s changed:\n%s", f, after[f])
					}
				}
				for _, f := range tc.gone {
					if _, ok := after[f]; ok {
						t.Errorf("%s still present", f)
					}
				}
				for _, d := range n.binDirs {
					if b, err := os.ReadFile(filepath.Join(d, PluginType)); err != nil || string(b) != "#!plugin v1" {
						t.Errorf("binary in %s: %q, %v", d, b, err)
					}
					if b, err := os.ReadFile(filepath.Join(d, fallback.BinaryName)); err != nil || string(b) != "#!fallback v1" {
						t.Errorf("fallback binary in %s: %q, %v", d, b, err)
					}
				}
				assertSecondPassNoop(t, inst, n.confDir, after)
			}

			if err := inst.Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			restored := snapshot(t, n.confDir)
			if !slices.Equal(slices.Sorted(maps.Keys(restored)), slices.Sorted(maps.Keys(tc.files))) {
				t.Errorf("after cleanup files = %v, want %v", slices.Sorted(maps.Keys(restored)), slices.Sorted(maps.Keys(tc.files)))
			}
			for name, orig := range tc.files {
				want := orig
				if name == "10-a.conflist" && orig == installed {
					want = `{"cniVersion":"1.0.0","name":"a","plugins":[{"type":"ptp"}]}`
				}
				if !jsonEqual(restored[name], want) {
					t.Errorf("%s after cleanup:\n%s\nwant\n%s", name, restored[name], want)
				}
			}
			if bins := snapshot(t, n.binDirs[0]); !maps.Equal(bins, map[string]string{"bridge": "#!bridge"}) {
				t.Errorf("bin dir after cleanup = %v", bins)
			}
			if bins := snapshot(t, n.binDirs[1]); len(bins) != 0 {
				t.Errorf("second bin dir after cleanup = %v", bins)
			}
		})
	}
}

// assertSecondPassNoop checks that another pass rewrites nothing in dir,
// which held after.
func assertSecondPassNoop(t *testing.T, inst *Installer, dir string, after map[string]string) {
	t.Helper()
	if err := inst.Install(context.Background()); err != nil {
		t.Fatalf("second Install: %v", err)
	}
	if again := snapshot(t, dir); !maps.Equal(again, after) {
		t.Errorf("second install changed files:\n%v\n%v", after, again)
	}
}

func assertOurEntry(t *testing.T, n *node, content string) {
	t.Helper()
	var l struct {
		Plugins []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal([]byte(content), &l); err != nil {
		t.Fatal(err)
	}
	for _, p := range l.Plugins {
		if p["type"] == PluginType {
			if p["agentSocket"] != "/var/run/ambient-ebpf/cni.sock" || p["kubeconfig"] != n.cfg.KubeconfigPath {
				t.Errorf("our entry = %v", p)
			}
			return
		}
	}
	t.Errorf("no %s entry in %s", PluginType, content)
}

func TestPrimaryRewritingItsConfAfterConversion(t *testing.T) {
	n := newNode(t, map[string]string{"10-bridge.conf": bridgeConf})
	inst := New(n.cfg)
	if err := inst.Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	rewritten := strings.Replace(bridgeConf, "cni0", "cni1", 1)
	mustWrite(t, filepath.Join(n.confDir, "10-bridge.conf"), rewritten)
	if err := inst.Install(context.Background()); err != nil {
		t.Fatalf("Install after the primary rewrote its conf: %v", err)
	}
	files := snapshot(t, n.confDir)
	if _, ok := files["10-bridge.conf"]; ok {
		t.Error("the rewritten .conf was not converted again")
	}
	list := files["10-bridge.conflist"]
	if !strings.Contains(list, "cni1") || !slices.Equal(pluginTypes(t, list), []string{"bridge", PluginType}) {
		t.Errorf("conflist = %s", list)
	}
	if err := inst.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := snapshot(t, n.confDir); len(got) != 1 || !jsonEqual(got["10-bridge.conf"], rewritten) {
		t.Errorf("after cleanup = %v, want the rewritten conf back", got)
	}

	// A conflist of that name that is not ours is never overwritten.
	n = newNode(t, map[string]string{"10-bridge.conf": bridgeConf, "10-bridge.conflist": listB})
	if err := New(n.cfg).Install(context.Background()); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Errorf("Install over a foreign conflist = %v", err)
	}
	if got := snapshot(t, n.confDir)["10-bridge.conflist"]; got != listB {
		t.Errorf("foreign conflist changed: %s", got)
	}
}

func TestKubeconfigCarriesTheTokenAndCA(t *testing.T) {
	n := newNode(t, map[string]string{"10-a.conflist": listA})
	if err := New(n.cfg).Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(n.cfg.KubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("kubeconfig mode %v, want 0600", fi.Mode().Perm())
	}
	kc, err := clientcmd.LoadFromFile(n.cfg.KubeconfigPath)
	if err != nil {
		t.Fatal(err)
	}
	ctx := kc.Contexts[kc.CurrentContext]
	if ctx == nil || kc.AuthInfos[ctx.AuthInfo].Token != "token-1" || kc.Clusters[ctx.Cluster].Server != "https://198.18.0.1:6443" ||
		!bytes.Contains(kc.Clusters[ctx.Cluster].CertificateAuthorityData, []byte("MIIB")) {
		t.Errorf("kubeconfig = %+v", kc)
	}
}

func TestRunRepairsDrift(t *testing.T) {
	n := newNode(t, map[string]string{"10-a.conflist": listA})
	inst := New(n.cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- inst.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if err := inst.Cleanup(); err != nil {
			t.Errorf("Cleanup: %v", err)
		}
	}()
	testenv.Eventually(t, 10*time.Second, "installed", func() bool { return inst.Ready() })

	bin := filepath.Join(n.binDirs[1], PluginType)
	if err := os.Remove(bin); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "binary restored", func() bool { _, err := os.Stat(bin); return err == nil })

	mustWrite(t, filepath.Join(n.confDir, "10-a.conflist"), listA) // the primary CNI rewrote its conflist
	testenv.Eventually(t, 10*time.Second, "entry re-added", func() bool {
		b, _ := os.ReadFile(filepath.Join(n.confDir, "10-a.conflist"))
		return strings.Contains(string(b), PluginType)
	})

	mustWrite(t, n.cfg.TokenPath, "token-2\n") // the token rotated
	testenv.Eventually(t, 10*time.Second, "kubeconfig rewritten", func() bool {
		kc, err := clientcmd.LoadFromFile(n.cfg.KubeconfigPath)
		return err == nil && kc.AuthInfos[PluginType] != nil && kc.AuthInfos[PluginType].Token == "token-2"
	})

	mustWrite(t, filepath.Join(n.confDir, "05-new.conflist"), listB) // a higher-priority conflist appeared
	testenv.Eventually(t, 10*time.Second, "entry moved to the new highest-priority conflist", func() bool {
		newer, _ := os.ReadFile(filepath.Join(n.confDir, "05-new.conflist"))
		older, _ := os.ReadFile(filepath.Join(n.confDir, "10-a.conflist"))
		return strings.Contains(string(newer), PluginType) && jsonEqual(string(older), listA)
	})
	testenv.Eventually(t, 10*time.Second, "ready again", func() bool { return inst.Ready() })
}

// OnResult hears istio-cni's results: SUCCESS when a pass makes the
// installation ready, the failing step otherwise, nothing while the node's
// primary CNI has written no configuration yet.
func TestInstallResults(t *testing.T) {
	cases := []struct {
		name    string
		files   map[string]string
		breakIt func(n *node)
		want    []string
	}{
		{name: "ready once", files: map[string]string{"10-a.conflist": listA}, want: []string{ResultSuccess}},
		{name: "no plugin binary", files: map[string]string{"10-a.conflist": listA},
			breakIt: func(n *node) { n.cfg.PluginBinary += ".missing" }, want: []string{ResultCopyBinariesFailure}},
		{name: "no service-account token", files: map[string]string{"10-a.conflist": listA},
			breakIt: func(n *node) { n.cfg.TokenPath += ".missing" }, want: []string{ResultCreateKubeconfigFailure}},
		{name: "conf dir gone", files: map[string]string{"10-a.conflist": listA},
			breakIt: func(n *node) { n.cfg.ConfDir += ".missing"; n.cfg.KubeconfigPath = "" }, want: []string{ResultCreateCNIConfigFailure}},
		{name: "primary CNI not there yet", files: map[string]string{}, want: nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.files)
			if tc.breakIt != nil {
				tc.breakIt(n)
			}
			var got []string
			n.cfg.OnResult = func(r string) { got = append(got, r) }
			inst := New(n.cfg)
			for range 2 { // a second pass that changes nothing reports nothing new
				_ = inst.Install(context.Background())
				if tc.breakIt != nil {
					break
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("results %v, want %v", got, tc.want)
			}
			for _, r := range got {
				if !slices.Contains(Results(), r) {
					t.Errorf("result %q is not in Results()", r)
				}
			}
		})
	}
}
