// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package install

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

const ownedName = "00-ambient-ebpf.conflist"

// selected is the file a runtime loads from dir, the first by name that
// parses, with its plugin types.
func selected(t *testing.T, dir string) (string, []string) {
	t.Helper()
	files, err := ReadConfDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if f.Err == "" {
			return filepath.Base(f.Path), f.Plugins
		}
	}
	return "", nil
}

// holdingUs lists the files of dir that name our plugin.
func holdingUs(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	for name, content := range snapshot(t, dir) {
		if ext := filepath.Ext(name); (ext == ".conf" || ext == ".conflist" || ext == ".json") && strings.Contains(content, `"`+PluginType+`"`) {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// The owned conflist is the primary's plugins with ours appended, in a file
// runtimes select first; every other trace of us (an entry chained in
// place, a converted conf, an owned list of an older name) is removed, and
// uninstall leaves the primary's files as the primary wrote them.
func TestOwnedConflist(t *testing.T) {
	cases := []struct {
		name  string
		files map[string]string
		want  []string // plugin types of the owned conflist
		// after uninstall: the conf dir's files and their plugin types.
		restored map[string][]string
	}{
		{name: "primary conflist", files: map[string]string{"10-a.conflist": listA, "20-b.conflist": listB},
			want: []string{"ptp", "portmap", PluginType}, restored: map[string][]string{"10-a.conflist": {"ptp", "portmap"}, "20-b.conflist": {"bridge"}}},
		{name: "lone conf stays as it is", files: map[string]string{"10-bridge.conf": bridgeConf},
			want: []string{"bridge", PluginType}, restored: map[string][]string{"10-bridge.conf": {"bridge"}}},
		{name: "entry chained in place is moved out", files: map[string]string{"10-a.conflist": installed},
			want: []string{"ptp", PluginType}, restored: map[string][]string{"10-a.conflist": {"ptp"}}},
		{name: "converted conf is restored", files: map[string]string{"10-bridge.conflist": convertedList("10-bridge.conf")},
			want: []string{"bridge", PluginType}, restored: map[string][]string{"10-bridge.conf": {"bridge"}}},
		{name: "owned list of an older name is removed", files: map[string]string{"10-a.conflist": listA,
			"01-old.conflist": `{"cniVersion":"1.0.0","name":"a","ambientEbpfOwnedFrom":"10-a.conflist","plugins":[{"type":"ptp"},{"type":"ambient-ebpf-cni"}]}`},
			want: []string{"ptp", "portmap", PluginType}, restored: map[string][]string{"10-a.conflist": {"ptp", "portmap"}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.files)
			n.cfg.OwnedConflist = ownedName
			inst := New(n.cfg)
			if err := inst.Install(context.Background()); err != nil {
				t.Fatalf("Install: %v", err)
			}
			if !inst.Ready() {
				t.Error("not ready after install")
			}
			if name, types := selected(t, n.confDir); name != ownedName || !slices.Equal(types, tc.want) {
				t.Errorf("runtimes select %s %v, want %s %v", name, types, ownedName, tc.want)
			}
			if got := holdingUs(t, n.confDir); !slices.Equal(got, []string{ownedName}) {
				t.Errorf("files naming our plugin: %v, want only %s", got, ownedName)
			}
			after := snapshot(t, n.confDir)
			assertOurEntry(t, n, after[ownedName])
			assertSecondPassNoop(t, inst, n.confDir, after)

			if err := inst.Cleanup(); err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			got := map[string][]string{}
			for name, content := range snapshot(t, n.confDir) {
				if strings.HasSuffix(name, ".conflist") {
					got[name] = pluginTypes(t, content)
				} else {
					got[name] = []string{pluginType([]byte(content))}
				}
			}
			if !maps.EqualFunc(got, tc.restored, slices.Equal) {
				t.Errorf("after uninstall %v, want %v", got, tc.restored)
			}
			if f := tc.files["10-bridge.conf"]; f != "" && snapshot(t, n.confDir)["10-bridge.conf"] != f {
				t.Error("uninstall rewrote the primary's lone conf")
			}
		})
	}
}

// The primary CNI rewrites its own file at start without our entry (Cilium,
// Calico and flannel's installers do): the owned conflist is still the one
// runtimes select, and the installer re-syncs it from the new content.
func TestOwnedConflistFollowsThePrimary(t *testing.T) {
	n := newNode(t, map[string]string{"10-a.conflist": listA})
	n.cfg.OwnedConflist = ownedName
	inst := New(n.cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- inst.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	testenv.Eventually(t, 10*time.Second, "installed", func() bool { return inst.Ready() })

	rewritten := strings.Replace(listA, "198.18.1.0/24", "198.18.2.0/24", 1)
	mustWrite(t, filepath.Join(n.confDir, "10-a.conflist"), rewritten)
	testenv.Eventually(t, 10*time.Second, "owned conflist re-synced", func() bool {
		b, _ := os.ReadFile(filepath.Join(n.confDir, ownedName))
		return strings.Contains(string(b), "198.18.2.0/24")
	})
	if name, types := selected(t, n.confDir); name != ownedName || !slices.Equal(types, []string{"ptp", "portmap", PluginType}) {
		t.Errorf("runtimes select %s %v", name, types)
	}
	if got := snapshot(t, n.confDir)["10-a.conflist"]; got != rewritten {
		t.Errorf("the primary's own file was rewritten by the installer:\n%s", got)
	}

	// The primary moves to a lone conf of another name.
	if err := os.Remove(filepath.Join(n.confDir, "10-a.conflist")); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, filepath.Join(n.confDir, "05-bridge.conf"), bridgeConf)
	testenv.Eventually(t, 10*time.Second, "owned conflist follows the new primary", func() bool {
		name, types := selected(t, n.confDir)
		return name == ownedName && slices.Equal(types, []string{"bridge", PluginType})
	})

	// Our own file removed or truncated by someone: written again.
	if err := os.WriteFile(filepath.Join(n.confDir, ownedName), []byte(`{"cniVersion":"1.0.0","plug`), 0o644); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "owned conflist repaired", func() bool {
		name, types := selected(t, n.confDir)
		return name == ownedName && slices.Equal(types, []string{"bridge", PluginType})
	})
	if err := os.Remove(filepath.Join(n.confDir, ownedName)); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 10*time.Second, "owned conflist rewritten", func() bool {
		name, _ := selected(t, n.confDir)
		return name == ownedName
	})
	testenv.Eventually(t, 10*time.Second, "ready", func() bool { return inst.Ready() })
}

// A reboot cut a write short: a half-written owned file and the temp file
// of the interrupted write are repaired; a corrupt primary is skipped as
// runtimes skip it, or refused with an error naming it while nothing else
// is there; an owned file already written keeps ours selected meanwhile.
func TestOwnedConflistCorruptFilesAtStart(t *testing.T) {
	half := `{"cniVersion":"1.0.0","name":"a","ambientEbpfOwnedFrom":"10-a.conflist","plugins":[{"type":"ptp"},{"ty`

	t.Run("half-written owned file", func(t *testing.T) {
		n := newNode(t, map[string]string{"10-a.conflist": listA, ownedName: half})
		stale := filepath.Join(n.confDir, "."+ownedName+".tmp.0badf00d")
		mustWrite(t, stale, half)
		old := time.Now().Add(-time.Hour)
		if err := os.Chtimes(stale, old, old); err != nil {
			t.Fatal(err)
		}
		n.cfg.OwnedConflist = ownedName
		if err := New(n.cfg).Install(context.Background()); err != nil {
			t.Fatalf("Install: %v", err)
		}
		if name, types := selected(t, n.confDir); name != ownedName || !slices.Equal(types, []string{"ptp", "portmap", PluginType}) {
			t.Errorf("runtimes select %s %v", name, types)
		}
		if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("stale temp file of the interrupted write: %v", err)
		}
	})

	t.Run("half-written primary, another conf parses", func(t *testing.T) {
		n := newNode(t, map[string]string{"10-a.conflist": listA[:40], "99-b.conflist": listB})
		n.cfg.OwnedConflist = ownedName
		if err := New(n.cfg).Install(context.Background()); err != nil {
			t.Fatalf("Install: %v", err)
		}
		// The runtime without us would have picked 99-b: ours is that plus us.
		if name, types := selected(t, n.confDir); name != ownedName || !slices.Equal(types, []string{"bridge", PluginType}) {
			t.Errorf("runtimes select %s %v", name, types)
		}
	})

	t.Run("half-written primary alone", func(t *testing.T) {
		n := newNode(t, map[string]string{"10-a.conflist": listA[:40]})
		n.cfg.OwnedConflist = ownedName
		inst := New(n.cfg)
		err := inst.Install(context.Background())
		if !errors.Is(err, ErrNoPrimaryConfig) || !strings.Contains(err.Error(), filepath.Join(n.confDir, "10-a.conflist")) {
			t.Fatalf("Install = %v, want %v naming the unparsable file", err, ErrNoPrimaryConfig)
		}
		if inst.Ready() {
			t.Error("ready without an owned conflist")
		}
		if name, _ := selected(t, n.confDir); name != "" {
			t.Errorf("runtimes select %s", name)
		}
	})

	t.Run("half-written primary after install", func(t *testing.T) {
		n := newNode(t, map[string]string{"10-a.conflist": listA})
		n.cfg.OwnedConflist = ownedName
		inst := New(n.cfg)
		if err := inst.Install(context.Background()); err != nil {
			t.Fatal(err)
		}
		before := snapshot(t, n.confDir)[ownedName]
		mustWrite(t, filepath.Join(n.confDir, "10-a.conflist"), listA[:40]) // the primary caught mid-write at boot
		if err := inst.Install(context.Background()); !errors.Is(err, ErrNoPrimaryConfig) || !strings.Contains(err.Error(), "10-a.conflist") {
			t.Fatalf("Install = %v, want an error naming 10-a.conflist", err)
		}
		if got := snapshot(t, n.confDir)[ownedName]; got != before {
			t.Errorf("owned conflist changed while the primary was unreadable:\n%s", got)
		}
		if name, types := selected(t, n.confDir); name != ownedName || !slices.Contains(types, PluginType) {
			t.Errorf("runtimes select %s %v", name, types)
		}
	})

	t.Run("foreign file of the owned name", func(t *testing.T) {
		n := newNode(t, map[string]string{"10-a.conflist": listA, ownedName: listB})
		n.cfg.OwnedConflist = ownedName
		err := New(n.cfg).Install(context.Background())
		if err == nil || !strings.Contains(err.Error(), "not ours") || !strings.Contains(err.Error(), ownedName) {
			t.Fatalf("Install = %v, want a refusal naming %s", err, ownedName)
		}
		if got := snapshot(t, n.confDir)[ownedName]; got != listB {
			t.Errorf("foreign file overwritten: %s", got)
		}
	})

	t.Run("primary sorts first", func(t *testing.T) {
		n := newNode(t, map[string]string{"00-a.conflist": listA})
		n.cfg.OwnedConflist = "50-ambient-ebpf.conflist"
		err := New(n.cfg).Install(context.Background())
		if err == nil || !strings.Contains(err.Error(), "does not sort before") || !strings.Contains(err.Error(), "00-a.conflist") {
			t.Fatalf("Install = %v, want a refusal naming both files", err)
		}
	})
}

// Two agents install at once (a DaemonSet pod and its replacement): renames
// are atomic, so a reader never sees a partial owned file, both passes
// succeed, and the result holds exactly one entry of ours.
func TestOwnedConflistRacingInstallers(t *testing.T) {
	n := newNode(t, map[string]string{"10-a.conflist": listA})
	n.cfg.OwnedConflist = ownedName
	path := filepath.Join(n.confDir, ownedName)
	stop := make(chan struct{})
	var readerErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			b, err := os.ReadFile(path)
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			if err == nil {
				d, perr := parseDocument(b)
				if perr != nil || !d.isList() || len(slices.DeleteFunc(slices.Clone(d.plugins), func(p json.RawMessage) bool { return pluginType(p) != PluginType })) != 1 {
					err = fmt.Errorf("owned conflist read mid-race: %s (%v)", b, perr)
				}
			}
			if err != nil {
				readerErr = err
				return
			}
		}
	}()
	errs := make(chan error, 2*50)
	for range 2 {
		inst := New(n.cfg)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				errs <- inst.Install(context.Background())
			}
		}()
	}
	// The primary rewrites its file meanwhile, by rename (a primary caught
	// mid-write fails a pass: TestOwnedConflistCorruptFilesAtStart).
	for k := range 20 {
		content := strings.Replace(listA, "198.18.1.0/24", fmt.Sprintf("198.18.%d.0/24", k), 1)
		if err := atomicWrite(filepath.Join(n.confDir, "10-a.conflist"), strings.NewReader(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("racing Install: %v", err)
		}
	}
	if readerErr != nil {
		t.Fatal(readerErr)
	}
	if err := New(n.cfg).Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	files := snapshot(t, n.confDir)
	if !strings.Contains(files[ownedName], "198.18.19.0/24") || !slices.Equal(pluginTypes(t, files[ownedName]), []string{"ptp", "portmap", PluginType}) {
		t.Errorf("owned conflist after the race: %s", files[ownedName])
	}
	for name := range files {
		if strings.Contains(name, ".tmp.") {
			t.Errorf("temp file left: %s", name)
		}
	}
	if got := holdingUs(t, n.confDir); !slices.Equal(got, []string{ownedName}) {
		t.Errorf("files naming our plugin: %v", got)
	}
}

// After uninstall, the primary starting again (writing its file) finds no
// trace of us; switching the installer between owned and in-place chaining
// leaves exactly one entry of ours.
func TestOwnedConflistUninstallAndModeSwitch(t *testing.T) {
	n := newNode(t, map[string]string{"10-a.conflist": listA})
	n.cfg.OwnedConflist = ownedName
	if err := New(n.cfg).Install(context.Background()); err != nil {
		t.Fatal(err)
	}

	inPlace := n.cfg
	inPlace.OwnedConflist = ""
	if err := New(inPlace).Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := holdingUs(t, n.confDir); !slices.Equal(got, []string{"10-a.conflist"}) {
		t.Errorf("after switching to in-place chaining, files naming us: %v", got)
	}
	if err := New(n.cfg).Install(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := holdingUs(t, n.confDir); !slices.Equal(got, []string{ownedName}) {
		t.Errorf("after switching back to owned, files naming us: %v", got)
	}

	if err := New(n.cfg).Cleanup(); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, filepath.Join(n.confDir, "10-a.conflist"), listA) // the primary starts again
	if got := snapshot(t, n.confDir); !maps.Equal(got, map[string]string{"10-a.conflist": listA}) {
		t.Errorf("after uninstall and the primary's start: %v", got)
	}
	if name, types := selected(t, n.confDir); name != "10-a.conflist" || slices.Contains(types, PluginType) {
		t.Errorf("runtimes select %s %v", name, types)
	}
}
