// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package upgrade

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// The upgrade's pins under the bpffs directory.
const (
	RecordPin  = "ae_layout" // the layout record
	StagingDir = "next"      // during an upgrade: maps of the new layout being filled
)

const (
	// releaseLayout is the layout of pins without a record: v0.1.0's.
	releaseLayout  = 1
	releaseVersion = "v0.1.0 (no layout record)"

	layoutStable    = 0
	layoutUpgrading = 1
)

// layoutRecord is the value of the pinned record (struct ae_layout in its
// BTF, so bpftool prints it).
type layoutRecord struct {
	Layout      uint32   // the layout of the pins
	Compat      uint32   // the oldest layout whose agent may take them over
	State       uint32   // layoutStable or layoutUpgrading
	FromLayout  uint32   // upgrading: from this layout
	Version     [64]byte // the build that wrote the record
	FromVersion [64]byte // upgrading: the build that wrote the old pins
}

// Layout is the pinned state's record, as ReadLayout and the runtime's
// start read it.
type Layout struct {
	Layout    int    `json:"layout"`    // the pinned layout
	Compat    int    `json:"compat"`    // the oldest layout whose agent may take the pins over
	Version   string `json:"version"`   // the agent build that wrote them
	Upgrading bool   `json:"upgrading"` // an upgrade was started and not finished
	Recorded  bool   `json:"recorded"`  // false: pins of v0.1.0, which wrote no record
}

// BuildLayout is this build's pinned layout.
func BuildLayout() int { return layoutVersion }

func (r layoutRecord) public(recorded bool) Layout {
	return Layout{Layout: int(r.Layout), Compat: int(r.Compat), Version: bpfobj.GoString(r.Version[:]),
		Upgrading: r.State == layoutUpgrading, Recorded: recorded}
}

func layoutRecordSpec() *ebpf.MapSpec {
	u32 := &btf.Int{Name: "__u32", Size: 4}
	str := &btf.Array{Index: u32, Type: &btf.Int{Name: "char", Size: 1, Encoding: btf.Char}, Nelems: 64}
	value := &btf.Struct{Name: "ae_layout", Size: 144, Members: []btf.Member{
		{Name: "layout", Type: u32, Offset: 0},
		{Name: "compat", Type: u32, Offset: 32},
		{Name: "state", Type: u32, Offset: 64},
		{Name: "from_layout", Type: u32, Offset: 96},
		{Name: "version", Type: str, Offset: 128},
		{Name: "from_version", Type: str, Offset: 128 + 64*8},
	}}
	return &ebpf.MapSpec{Name: RecordPin, Type: ebpf.Array, KeySize: 4, ValueSize: 144, MaxEntries: 1, Key: u32, Value: value}
}

// readLayout returns the pinned record; without one, the layout of
// v0.1.0 when there are pins, and ok false when there are none (a first
// start).
func readLayout(bpffsDir string) (rec layoutRecord, recorded, ok bool, err error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(bpffsDir, RecordPin), &ebpf.LoadPinOptions{ReadOnly: true})
	if err == nil {
		defer m.Close()
		if err := m.Lookup(uint32(0), &rec); err != nil {
			return rec, false, false, fmt.Errorf("read %s: %w", RecordPin, err)
		}
		return rec, true, true, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return rec, false, false, fmt.Errorf("open %s: %w", RecordPin, err)
	}
	entries, _ := os.ReadDir(bpfobj.MapsDir(bpffsDir))
	if len(entries) == 0 {
		return rec, false, false, nil
	}
	rec = layoutRecord{Layout: releaseLayout, Compat: releaseLayout}
	bpfobj.CString(rec.Version[:], releaseVersion)
	return rec, false, true, nil
}

// writeLayout creates or updates the pinned record.
func writeLayout(bpffsDir string, rec layoutRecord) error {
	pin := filepath.Join(bpffsDir, RecordPin)
	m, err := ebpf.LoadPinnedMap(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		if m, err = ebpf.NewMap(layoutRecordSpec()); err == nil {
			if perr := m.Pin(pin); perr != nil {
				m.Close()
				return fmt.Errorf("pin %s: %w", RecordPin, perr)
			}
		}
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", RecordPin, err)
	}
	defer m.Close()
	if err := m.Put(uint32(0), &rec); err != nil {
		return fmt.Errorf("write %s: %w", RecordPin, err)
	}
	return nil
}

func thisVersion() string { return buildinfo.Read().Version }

// ReadLayout returns the layout of the pins under bpffsDir: the record,
// or layout 1 without one (v0.1.0 wrote none); bpfobj.ErrNotInstalled
// without pins.
func ReadLayout(bpffsDir string) (Layout, error) {
	rec, recorded, found, err := readLayout(bpffsDir)
	if err != nil {
		return Layout{}, err
	}
	if !found {
		return Layout{}, fmt.Errorf("%s: %w", bpffsDir, bpfobj.ErrNotInstalled)
	}
	return rec.public(recorded), nil
}

// WriteLayout writes a stable record of l's layout, compat layout and
// version for the pins under bpffsDir, as an agent of that build would
// (l.Upgrading and l.Recorded are ignored). Tests stand for another
// build's pins with it; an agent writes its record itself.
func WriteLayout(bpffsDir string, l Layout) error {
	rec := layoutRecord{Layout: uint32(l.Layout), Compat: uint32(l.Compat)}
	bpfobj.CString(rec.Version[:], l.Version)
	return writeLayout(bpffsDir, rec)
}

// Check refuses pins under bpffsDir that this build cannot take over
// (their compat layout is newer than this build's layout), naming both
// builds. It reads only: the runtime calls it before it creates anything.
func Check(bpffsDir string) error {
	rec, _, found, err := readLayout(bpffsDir)
	if err != nil {
		return err
	}
	if found && rec.Compat > layoutVersion {
		return refusal(bpffsDir, rec)
	}
	return nil
}

func refusal(bpffsDir string, from layoutRecord) error {
	version := bpfobj.GoString(from.Version[:])
	return fmt.Errorf("the pinned data path in %s is layout %d, written by ambient-ebpf %s; this agent, ambient-ebpf %s, has layout %d and cannot take over pins of layout %d or newer: start %s (or a later release) again, or uninstall the data path first",
		bpffsDir, from.Layout, version, thisVersion(), layoutVersion, from.Compat, version)
}
