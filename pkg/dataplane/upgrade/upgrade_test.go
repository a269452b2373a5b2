// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package upgrade

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
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
