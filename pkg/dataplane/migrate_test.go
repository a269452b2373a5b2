// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Entries convert field by field, matched by name: common fields are
// copied (integers widened or narrowed), new ones start zero, dropped
// ones go; a field that changes kind is refused.
func TestConvertMatchesFieldsByName(t *testing.T) {
	u16, u32, u64 := &btf.Int{Name: "u16", Size: 2}, &btf.Int{Name: "u32", Size: 4}, &btf.Int{Name: "u64", Size: 8}
	old := &btf.Struct{Name: "v1", Size: 16, Members: []btf.Member{
		{Name: "a", Type: u32, Offset: 0}, {Name: "gone", Type: u32, Offset: 32}, {Name: "b", Type: u64, Offset: 64}}}
	cur := &btf.Struct{Name: "v2", Size: 16, Members: []btf.Member{
		{Name: "b", Type: u64, Offset: 0}, {Name: "a", Type: u16, Offset: 64}, {Name: "added", Type: u32, Offset: 96}}}
	src := []byte{0x34, 0x12, 0, 0, 0xff, 0xff, 0xff, 0xff, 8, 7, 6, 5, 4, 3, 2, 1}
	got, err := convert(cur, old, src)
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{8, 7, 6, 5, 4, 3, 2, 1, 0x34, 0x12, 0, 0, 0, 0, 0, 0}
	if !bytes.Equal(got, want) {
		t.Errorf("upgrade: % x, want % x", got, want)
	}
	back, err := convert(old, cur, got)
	if err != nil {
		t.Fatal(err)
	}
	if wantBack := []byte{0x34, 0x12, 0, 0, 0, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1}; !bytes.Equal(back, wantBack) {
		t.Errorf("downgrade: % x, want % x", back, wantBack)
	}
	changed := &btf.Struct{Name: "v3", Size: 8, Members: []btf.Member{{Name: "b", Type: &btf.Struct{Name: "s", Size: 8, Members: []btf.Member{{Name: "x", Type: u64}}}}}}
	if err := convertible(changed, old); err == nil {
		t.Error("an integer that became a struct converted")
	}
	if shape(old) == shape(cur) || shape(old) != shape(&btf.Typedef{Name: "t", Type: old}) {
		t.Error("shape does not describe the layout alone")
	}
}

// The pinned layout of this build is the one layoutVersion names: a
// change to a pinned map (name, type, key, value, size) or to the
// programs fails here until layoutVersion is bumped and its fingerprint
// added to layoutFingerprints (layout.go).
func TestLayoutFingerprint(t *testing.T) {
	got := layoutFingerprint(t)
	want, ok := layoutFingerprints()[layoutVersion]
	if !ok || want != got {
		t.Errorf("the pinned layout's fingerprint is %s, layout %d's is %q: a change to the pinned maps or programs needs a new layout (layout.go)", got, layoutVersion, want)
	}
}

func layoutFingerprint(t *testing.T) string {
	t.Helper()
	var specs []*ebpf.CollectionSpec
	for _, load := range []func() (*ebpf.CollectionSpec, error){bpfobj.LoadSock, bpfobj.LoadTc} {
		cs, err := load()
		if err != nil {
			t.Fatal(err)
		}
		specs = append(specs, cs)
	}
	var lines []string
	for _, ms := range pinnedSpecs(specs...) {
		lines = append(lines, fmt.Sprintf("map %s %s %d %d %d %#x key=%s value=%s", ms.Name, ms.Type, ms.KeySize, ms.ValueSize, ms.MaxEntries, ms.Flags, shape(ms.Key), shape(ms.Value)))
	}
	for _, cs := range specs {
		for name, ps := range cs.Programs {
			lines = append(lines, fmt.Sprintf("prog %s %s %s", name, ps.Type, ps.AttachType))
		}
	}
	slices.Sort(lines)
	sum := sha256.Sum256([]byte(strings.Join(lines, "\n")))
	return hex.EncodeToString(sum[:8])
}

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
	future := layoutRecord{Layout: layoutVersion + 2, Compat: layoutVersion + 1}
	bpfobj.CString(future.Version[:], "v9.9.9")
	if err := writeLayout(cfg.BPFFSDir, future); err != nil {
		t.Fatal(err)
	}
	before := pinSnapshot(t, cfg.BPFFSDir)
	_, err := New(cfg)
	if err == nil {
		t.Fatal("New took over pins of a newer layout")
	}
	for _, want := range []string{"v9.9.9", thisVersion(), fmt.Sprintf("layout %d", layoutVersion+2), fmt.Sprintf("has layout %d", layoutVersion)} {
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
	if err := writeLayout(cfg.BPFFSDir, layoutRecord{Layout: layoutVersion, Compat: layoutCompat}); err != nil {
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
			if rel == layoutRecordPin {
				var rec layoutRecord
				_ = m.Lookup(uint32(0), &rec)
				fmt.Fprintf(&b, "%v;", rec)
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
	rec := layoutRecord{Layout: layoutVersion - 1, Compat: layoutVersion - 1}
	bpfobj.CString(rec.Version[:], "v0.0.9-old")
	if err := writeLayout(cfg.BPFFSDir, rec); err != nil {
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
	for _, step := range append([]string{""}, MigrateSteps...) {
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
			if l, err := ReadLayout(cfg.BPFFSDir); err != nil || l.Layout != layoutVersion || l.Migrating || l.Version != thisVersion() {
				t.Errorf("record after the migration %+v, %v", l, err)
			}
			if _, err := os.Stat(filepath.Join(cfg.BPFFSDir, stagingDir)); !os.IsNotExist(err) {
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
