// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/upgrade"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The data path's side of package upgrade: New upgrades pins of another
// layout and refuses those it cannot take over.

// Pins whose record asks for a newer layout than this build's are refused
// before anything is touched, naming both versions; the data path keeps
// running on the pins as they are.
func TestNewRefusesANewerLayoutAndTouchesNothing(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	d := newDataplane(t, n)
	if err := d.Enroll(context.Background(), podOf(p)); err != nil {
		t.Fatal(err)
	}
	if err := d.Close(); err != nil {
		t.Fatal(err)
	}
	own, err := upgrade.ReadLayout(cfg.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	build := upgrade.BuildLayout()
	future := upgrade.Layout{Layout: build + 2, Compat: build + 1, Version: "v9.9.9"}
	if err := upgrade.WriteLayout(cfg.BPFFSDir, future); err != nil {
		t.Fatal(err)
	}
	before := pinSnapshot(t, cfg.BPFFSDir)
	_, err = New(cfg)
	if err == nil {
		t.Fatal("New took over pins of a newer layout")
	}
	for _, want := range []string{"v9.9.9", buildinfo.Read().Version, fmt.Sprintf("layout %d", build+2), fmt.Sprintf("has layout %d", build)} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not name %q", err, want)
		}
	}
	if after := pinSnapshot(t, cfg.BPFFSDir); after != before {
		t.Errorf("the refused start changed the pins:\nbefore %s\nafter  %s", before, after)
	}
	if got := ingressPrograms(t, p); got != 1 {
		t.Errorf("%d programs on the pod's lo after the refusal, want 1", got)
	}
	// An agent of that layout (here: the record put back) takes over.
	if err := upgrade.WriteLayout(cfg.BPFFSDir, upgrade.Layout{Layout: own.Layout, Compat: own.Compat}); err != nil {
		t.Fatal(err)
	}
	d2 := newDataplane(t, n)
	if got := d2.List(); len(got) != 1 {
		t.Errorf("adopted %+v", got)
	}
}

// pinSnapshot describes every pin: its path and the id of the map,
// program or link's program it holds, and the record's bytes.
func pinSnapshot(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	_ = filepath.WalkDir(dir, func(path string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(dir, path)
		fmt.Fprintf(&b, "%s=", rel)
		if l, err := link.LoadPinnedLink(path, nil); err == nil {
			info, _ := l.Info()
			fmt.Fprintf(&b, "link:%d;", info.Program)
			l.Close()
		} else if m, err := ebpf.LoadPinnedMap(path, nil); err == nil {
			info, _ := m.Info()
			id, _ := info.ID()
			fmt.Fprintf(&b, "map:%d;", id)
			if rel == upgrade.RecordPin {
				rec, _ := m.LookupBytes(uint32(0))
				fmt.Fprintf(&b, "%x;", rec)
			}
			m.Close()
		} else if prog, err := ebpf.LoadPinnedProgram(path, nil); err == nil {
			info, _ := prog.Info()
			id, _ := info.ID()
			fmt.Fprintf(&b, "prog:%d;", id)
			prog.Close()
		}
		return nil
	})
	return b.String()
}

// oldPodInfo is ae_pods' value of a made-up earlier layout: no ifindex,
// no pad. Pins of it stand for an older agent's.
func oldPodInfo() *btf.Struct {
	u32, u64 := &btf.Int{Name: "__u32", Size: 4}, &btf.Int{Name: "__u64", Size: 8}
	return &btf.Struct{Name: "pod_info", Size: 16, Members: []btf.Member{
		{Name: "netns_cookie", Type: u64, Offset: 0}, {Name: "slot", Type: u32, Offset: 64}, {Name: "flags", Type: u32, Offset: 96}}}
}

// pinOldLayout replaces the pinned ae_pods with a map of oldPodInfo's
// layout holding the same pods (as an older agent would have left it),
// and marks the record as that older layout's.
func pinOldLayout(t *testing.T, cfg Config) {
	t.Helper()
	cur, err := ebpf.LoadPinnedMap(filepath.Join(mapsDir(cfg), "ae_pods"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cur.Close()
	spec, err := bpfobj.LoadSock()
	if err != nil {
		t.Fatal(err)
	}
	ms := spec.Maps["ae_pods"].Copy()
	ms.Value, ms.ValueSize, ms.Pinning = oldPodInfo(), 16, ebpf.PinNone
	old, err := ebpf.NewMap(ms)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	var k bpfobj.SockAeAddr
	var v bpfobj.SockPodInfo
	it := cur.Iterate()
	for it.Next(&k, &v) {
		val := make([]byte, 16)
		copy(val, ebpfBytes(v.NetnsCookie, v.Slot, v.Flags))
		if err := old.Put(k, val); err != nil {
			t.Fatal(err)
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	pin := filepath.Join(mapsDir(cfg), "ae_pods")
	if err := os.Remove(pin); err != nil {
		t.Fatal(err)
	}
	if err := old.Pin(pin); err != nil {
		t.Fatal(err)
	}
	older := upgrade.BuildLayout() - 1
	if err := upgrade.WriteLayout(cfg.BPFFSDir, upgrade.Layout{Layout: older, Compat: older, Version: "v0.0.9-old"}); err != nil {
		t.Fatal(err)
	}
}

func ebpfBytes(cookie uint64, slot, flags uint32) []byte {
	b := make([]byte, 16)
	for i := 0; i < 8; i++ {
		b[i] = byte(cookie >> (8 * i))
	}
	for i := 0; i < 4; i++ {
		b[8+i] = byte(slot >> (8 * i))
		b[12+i] = byte(flags >> (8 * i))
	}
	return b
}

// Pins of another layout (ae_pods' value without two fields) are migrated
// by New, also when an agent is killed at any migration step first: the
// map gets the current layout with every entry (common fields kept), the
// pod stays enrolled and redirected, nothing of the old layout stays
// pinned and the record is this build's.
func TestNewMigratesAMapOfAnotherLayout(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	for _, step := range append([]string{""}, upgrade.Steps...) {
		t.Run("crash at "+step, func(t *testing.T) {
			d := newDataplane(t, n)
			if err := d.Enroll(context.Background(), podOf(p)); err != nil {
				t.Fatal(err)
			}
			// A pod program of the old layout that this build has not:
			// a migration removes it.
			extra := attachment{pin: "old_extra", netns: p.NetnsPath(), iface: "lo", attach: ebpf.AttachTCXEgress, prog: d.tc.AePodLoIngress}
			if _, err := (classicHooks{}).attach(extra, filepath.Join(podDir(cfg, p.UID), extra.pin)); err != nil {
				t.Fatal(err)
			}
			want := map[bpfobj.SockAeAddr]bpfobj.SockPodInfo{}
			var k bpfobj.SockAeAddr
			var v bpfobj.SockPodInfo
			it := d.sock.AePods.Iterate()
			for it.Next(&k, &v) {
				v.Ifindex = 0 // the old layout has none
				want[k] = v
			}
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			pinOldLayout(t, cfg)
			if step != "" {
				runCrash(t, crashJob{BPFFSDir: cfg.BPFFSDir, CgroupRoot: cfg.CgroupRoot, NodeNetns: cfg.NodeNetns, Pod: podOf(p), Step: step, Nth: 1})
				if got := ingressPrograms(t, p); got < 1 {
					t.Errorf("%d programs on the pod's lo after the crash, want ours", got)
				}
			}
			d2 := newDataplane(t, n)
			got := map[bpfobj.SockAeAddr]bpfobj.SockPodInfo{}
			it = d2.sock.AePods.Iterate()
			for it.Next(&k, &v) {
				got[k] = v
			}
			if len(got) != len(want) || len(want) == 0 {
				t.Errorf("ae_pods after the migration %+v, want %+v", got, want)
			}
			for k, w := range want {
				if got[k] != w {
					t.Errorf("ae_pods[%v] = %+v, want %+v", k, got[k], w)
				}
			}
			if l, err := upgrade.ReadLayout(cfg.BPFFSDir); err != nil || l.Layout != upgrade.BuildLayout() || l.Upgrading || l.Version != buildinfo.Read().Version {
				t.Errorf("record after the migration %+v, %v", l, err)
			}
			if _, err := os.Stat(filepath.Join(cfg.BPFFSDir, upgrade.StagingDir)); !os.IsNotExist(err) {
				t.Errorf("staged maps left: %v", err)
			}
			if got := d2.List(); len(got) != 1 {
				t.Errorf("enrolled after the migration: %+v", got)
			}
			checkEnrolled(t, d2, p) // one program on lo: the old layout's is gone
			if n, err := (classicHooks{}).count(p.NetnsPath(), "lo", ebpf.AttachTCXEgress); err != nil || n != 0 {
				t.Errorf("%d programs left on the pod's lo egress (%v), want the old layout's gone", n, err)
			}
			if _, err := os.Stat(filepath.Join(podDir(cfg, p.UID), extra.pin)); !os.IsNotExist(err) {
				t.Errorf("the old layout's pod pin is left: %v", err)
			}
			if err := d2.Uninstall(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
