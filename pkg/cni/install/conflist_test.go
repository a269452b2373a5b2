// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package install

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

// convertedList is 10-bridge.conflist as a conversion left it, with the
// marker naming the file to restore on uninstall.
func convertedList(from string) string {
	marker, _ := json.Marshal(from)
	return `{"cniVersion":"1.0.0","name":"k8s-pod-network","plugins":[` + bridgeConf +
		`,{"type":"ambient-ebpf-cni","convertedFrom":` + string(marker) + `}]}`
}

// The marker is read from a file in the conf dir: uninstall restores only
// the lone conf the conflist was made from, never a path it names.
func TestUninstallRestoresOnlyTheConfTheListWasMadeFrom(t *testing.T) {
	for _, from := range []string{"..", ".", "../10-bridge.conf", "/etc/passwd", "sub/10-bridge.conf", "other.conf", "10-bridge", "10-bridge.conf\x00", ""} {
		t.Run(from, func(t *testing.T) {
			n := newNode(t, map[string]string{"10-bridge.conflist": convertedList(from)})
			parent := filepath.Dir(n.confDir)
			before, _ := os.ReadDir(parent)
			if err := New(n.cfg).Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			files := snapshot(t, n.confDir)
			if len(files) != 1 || !slices.Equal(pluginTypes(t, files["10-bridge.conflist"]), []string{"bridge"}) {
				t.Errorf("conf dir after cleanup = %v; want 10-bridge.conflist without our entry", files)
			}
			if after, _ := os.ReadDir(parent); len(after) != len(before) {
				t.Errorf("cleanup wrote next to the conf dir: %v -> %v", before, after)
			}
		})
	}
	n := newNode(t, map[string]string{"10-bridge.conflist": convertedList("10-bridge.conf")})
	if err := New(n.cfg).Cleanup(); err != nil {
		t.Fatal(err)
	}
	if got := snapshot(t, n.confDir); len(got) != 1 || !jsonEqual(got["10-bridge.conf"], bridgeConf) {
		t.Errorf("after cleanup = %v; want 10-bridge.conf back", got)
	}
}

// semantic decodes JSON for comparisons that ignore layout and escaping.
func semantic(t *testing.T, raw []byte) any {
	t.Helper()
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("output %q is not json: %v", raw, err)
	}
	return v
}

// foreign returns the plugins of a conflist that are not ours, decoded.
func foreign(t *testing.T, d *document) []any {
	t.Helper()
	var out []any
	for _, p := range d.plugins {
		if pluginType(p) != PluginType {
			out = append(out, semantic(t, p))
		}
	}
	return out
}

// Reading and rewriting any conf file: chaining in gives a conflist with
// exactly our one entry and every other plugin as it was; chaining in twice
// gives the same bytes as once; taking our entry out leaves no entry of
// ours and gives back the lone conf a conversion came from, and a restore
// name is only ever the conf the list was made from.
func FuzzConflist(f *testing.F) {
	for _, s := range []string{bridgeConf, listA, listB, installed, convertedList("10-x.conf"), convertedList("../../x.conf"),
		`{"plugins":null}`, `{"type":""}`, `{"plugins":[1,"x",null,{"type":"ambient-ebpf-cni","convertedFrom":".."}]}`, `[]`, `{"type":"a","type":"b"}`} {
		f.Add([]byte(s))
	}
	// entry only formats settings; nothing is read or written.
	entry, err := New(Config{Plugin: plugin.Settings{AgentSocket: "/run/x.sock", ExcludeNamespaces: []string{"kube-system"}},
		KubeconfigPath: "/host/kubeconfig"}).entry()
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		const confName, listName = "10-x.conf", "10-x.conflist"
		if _, restoreAs, _, err := withoutPlugin(data, PluginType, listName); err == nil && restoreAs != "" && restoreAs != "10-x.conf" && restoreAs != "10-x.json" {
			t.Fatalf("restore name %q for %s", restoreAs, listName)
		}
		in, err := parseDocument(data)
		if err != nil {
			return
		}
		out, err := withPlugin(data, entry, confName)
		if err != nil {
			return
		}
		d, err := parseDocument(out)
		if err != nil || !d.isList() {
			t.Fatalf("chained output %q is no conflist: %v", out, err)
		}
		if n := len(slices.DeleteFunc(slices.Clone(d.plugins), func(p json.RawMessage) bool { return pluginType(p) != PluginType })); n != 1 {
			t.Fatalf("%d entries of ours in %s", n, out)
		}
		wantForeign := foreign(t, in)
		if !in.isList() {
			wantForeign = []any{semantic(t, data)}
		}
		if got := foreign(t, d); !reflect.DeepEqual(got, wantForeign) {
			t.Fatalf("other plugins changed: %v -> %v", wantForeign, got)
		}
		again, err := withPlugin(out, entry, confName)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("second pass differs (%v):\n%s\n%s", err, out, again)
		}
		back, restoreAs, changed, err := withoutPlugin(out, PluginType, listName)
		if err != nil || !changed {
			t.Fatalf("unchain of %s: changed %v, %v", out, changed, err)
		}
		if restoreAs != "" {
			if restoreAs != confName {
				t.Fatalf("restore name %q", restoreAs)
			}
			if !in.isList() && !reflect.DeepEqual(semantic(t, back), semantic(t, data)) {
				t.Fatalf("restored %s; want %s", back, data)
			}
			return
		}
		if !in.isList() {
			t.Fatalf("a converted conf is not restored: %s", back)
		}
		rest, err := parseDocument(back)
		if err != nil || rest.ours(PluginType) >= 0 {
			t.Fatalf("unchained %s still holds our entry (%v)", back, err)
		}
	})
}

// The installer's own pass is idempotent on disk: a second Install rewrites
// nothing.
func TestSecondInstallRewritesNothing(t *testing.T) {
	for _, files := range []map[string]string{{"10-bridge.conf": bridgeConf}, {"10-a.conflist": listA}, {"10-a.conflist": installed}} {
		n := newNode(t, files)
		inst := New(n.cfg)
		if err := inst.Install(context.Background()); err != nil {
			t.Fatal(err)
		}
		first := snapshot(t, n.confDir)
		if err := inst.Install(context.Background()); err != nil {
			t.Fatal(err)
		}
		if second := snapshot(t, n.confDir); !reflect.DeepEqual(first, second) {
			t.Errorf("second install changed %v -> %v", first, second)
		}
	}
}
