// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// Upgrades and downgrades. The pins carry a record of their layout
// (<root>/ae_layout, read before anything is loaded); pins without one were
// written by v0.1.0, layout 1. When the pinned layout is not this build's,
// New migrates:
//
//  1. The record says "migrating" to this layout (from the old one); a
//     pinned layout this build cannot take over (its compat layout is
//     newer than ours) is refused before this, nothing touched.
//  2. Each map whose pinned layout differs gets a new map pinned under
//     <root>/next/, filled from the old one (converted field by field,
//     convert_linux.go). Unchanged maps are used as they are, with their
//     entries and sockets; a new map starts empty under maps/.
//  3. The programs are loaded on the new maps and every link is switched
//     to them in place (link update, tc filter replace): each hook runs
//     either the old programs on the old maps or the new ones on filled new
//     maps, never a program on an empty map.
//  4. Entries the old programs made while the links were switched are
//     copied too, the new maps replace the old pins (rename), old maps and
//     links this build does not have are removed, and the record says
//     "stable".
//
// Each step can be killed: the next agent, of this layout or the old one,
// plans again from what the pins are (a staged map of its layout is
// resumed, one of another layout replaced) and finishes.

// The migration's failpoints (Config.Failpoint), in order.
var MigrateSteps = []string{StepMigrateJournaled, StepMigrateCopied, StepMigrateSwitched, StepMigratePinned}

const (
	StepMigrateJournaled = "migrate/journaled" // the record says migrating; nothing else changed
	StepMigrateCopied    = "migrate/copied"    // new maps pinned under next/ and filled; no program uses them
	StepMigrateSwitched  = "migrate/switched"  // every link runs the new programs; old maps still pinned
	StepMigratePinned    = "migrate/pinned"    // new maps under maps/, old pins gone; the record not yet stable
)

const (
	layoutRecordPin = "ae_layout"
	stagingDir      = "next"
	// releaseLayout is the layout of pins without a record: v0.1.0's.
	releaseLayout  = 1
	releaseVersion = "v0.1.0 (no layout record)"

	layoutStable    = 0
	layoutMigrating = 1
)

// layoutRecord is the value of the pinned record (struct ae_layout in its
// BTF, so bpftool prints it).
type layoutRecord struct {
	Layout      uint32   // the layout of the pins
	Compat      uint32   // the oldest layout whose agent may take them over
	State       uint32   // layoutStable or layoutMigrating
	FromLayout  uint32   // migrating: from this layout
	Version     [64]byte // the build that wrote the record
	FromVersion [64]byte // migrating: the build that wrote the old pins
}

// Layout is the pinned state's record, as OpenPinned and New read it.
type Layout struct {
	Layout    int    `json:"layout"`    // the pinned layout
	Compat    int    `json:"compat"`    // the oldest layout whose agent may take the pins over
	Version   string `json:"version"`   // the agent build that wrote them
	Migrating bool   `json:"migrating"` // a migration was started and not finished
	Recorded  bool   `json:"recorded"`  // false: pins of v0.1.0, which wrote no record
}

// BuildLayout is this build's pinned layout.
func BuildLayout() int { return layoutVersion }

func (r layoutRecord) public(recorded bool) Layout {
	return Layout{Layout: int(r.Layout), Compat: int(r.Compat), Version: cStringOf(r.Version[:]),
		Migrating: r.State == layoutMigrating, Recorded: recorded}
}

func cStringOf(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
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
	return &ebpf.MapSpec{Name: layoutRecordPin, Type: ebpf.Array, KeySize: 4, ValueSize: 144, MaxEntries: 1, Key: u32, Value: value}
}

// readLayout returns the pinned record; without one, the layout of
// v0.1.0 when there are pins, and ok false when there are none (a first
// start).
func readLayout(bpffsDir string) (rec layoutRecord, recorded, ok bool, err error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(bpffsDir, layoutRecordPin), &ebpf.LoadPinOptions{ReadOnly: true})
	if err == nil {
		defer m.Close()
		if err := m.Lookup(uint32(0), &rec); err != nil {
			return rec, false, false, fmt.Errorf("read %s: %w", layoutRecordPin, err)
		}
		return rec, true, true, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return rec, false, false, fmt.Errorf("open %s: %w", layoutRecordPin, err)
	}
	entries, _ := os.ReadDir(filepath.Join(bpffsDir, "maps"))
	if len(entries) == 0 {
		return rec, false, false, nil
	}
	rec = layoutRecord{Layout: releaseLayout, Compat: releaseLayout}
	bpfobj.CString(rec.Version[:], releaseVersion)
	return rec, false, true, nil
}

// writeLayout creates or updates the pinned record.
func writeLayout(bpffsDir string, rec layoutRecord) error {
	pin := filepath.Join(bpffsDir, layoutRecordPin)
	m, err := ebpf.LoadPinnedMap(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		if m, err = ebpf.NewMap(layoutRecordSpec()); err == nil {
			if perr := m.Pin(pin); perr != nil {
				m.Close()
				return fmt.Errorf("pin %s: %w", layoutRecordPin, perr)
			}
		}
	}
	if err != nil {
		return fmt.Errorf("open %s: %w", layoutRecordPin, err)
	}
	defer m.Close()
	if err := m.Put(uint32(0), &rec); err != nil {
		return fmt.Errorf("write %s: %w", layoutRecordPin, err)
	}
	return nil
}

func thisVersion() string { return buildinfo.Read().Version }

// What becomes of one pinned map.
const (
	mapReuse   = iota // the pin has this build's layout: used as it is
	mapCreate         // no pin: a new, empty map
	mapConvert        // another layout: a new map, filled from the old one
	mapRefill         // another layout, entries that refill themselves: a new, empty map
)

// mapPlan is one pinned map of this build and what New does with it.
type mapPlan struct {
	spec   *ebpf.MapSpec
	action int
	old    *ebpf.Map // maps/<name> of another layout (mapConvert, mapRefill)
	oldBTF mapTypes
	target *ebpf.Map // what the programs use; pinned under maps/ or next/
	staged bool      // target is under next/, to replace the old pin
	resume bool      // target was staged by an agent killed part way
	why    string    // what differs
}

func (p *mapPlan) name() string { return p.spec.Name }

// migration is what New found and does about the pins' layout.
type migration struct {
	from, to     layoutRecord
	recorded     bool
	resumed      bool // a killed agent's migration is being finished
	maps         []*mapPlan
	byName       map[string]*mapPlan
	staleStaging []string // pins under next/ of another layout
	obsolete     []string // pins under maps/ this build has no map for
}

// active reports whether the pins change layout, or a migration is to be
// finished.
func (m *migration) active() bool {
	if m.from.Layout != m.to.Layout || m.from.State == layoutMigrating || m.resumed || len(m.staleStaging) > 0 || len(m.obsolete) > 0 {
		return true
	}
	for _, p := range m.maps {
		if p.action == mapConvert || p.action == mapRefill {
			return true
		}
	}
	return false
}

func (m *migration) close() {
	for _, p := range m.maps {
		if p.old != nil {
			p.old.Close()
		}
		if p.target != nil {
			p.target.Close()
		}
		p.old, p.target = nil, nil
	}
}

// refilled says why a map's entries need not be carried across a layout
// change, "" when they must be. Such maps hold per-connection state that
// the programs make again as traffic flows and that no connection needs
// once it is established.
func refilled(name string, typ ebpf.MapType) string {
	switch {
	case typ == ebpf.RingBuf:
		return "trace events in flight; tracers read the new ring"
	case name == "ae_sk_dst":
		// A socket between connect() and established during the switch
		// loses its original destination; ztunnel then falls back to
		// the accepted socket's local address, as for any pod without
		// the hook.
		return "a socket's original destination lives from connect() until established"
	case name == "ae_steer":
		return "a flow's entry lives from its SYN at tc until sk_lookup takes it"
	}
	return ""
}

// carried reports whether user space can copy a map type's entries.
func carried(typ ebpf.MapType) bool {
	switch typ {
	case ebpf.Hash, ebpf.Array, ebpf.PerCPUHash, ebpf.PerCPUArray, ebpf.LRUHash, ebpf.LRUCPUHash:
		return true
	}
	return false
}

// pinnedSpecs are the map specs of the collections that are pinned by
// name, by pin name (the objects share them: the first one counts).
func pinnedSpecs(specs ...*ebpf.CollectionSpec) []*ebpf.MapSpec {
	var out []*ebpf.MapSpec
	seen := map[string]bool{}
	for _, cs := range specs {
		keys := make([]string, 0, len(cs.Maps))
		for k := range cs.Maps {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			ms := cs.Maps[k]
			if ms.Pinning != ebpf.PinByName || seen[ms.Name] {
				continue
			}
			seen[ms.Name] = true
			out = append(out, ms)
		}
	}
	return out
}

// sameLayout reports whether m can serve as spec's map: what cilium/ebpf
// checks (type, sizes, entries, flags) and, where both carry BTF, the
// same shape of key and value.
func sameLayout(spec *ebpf.MapSpec, m *ebpf.Map, types mapTypes) (bool, string) {
	if err := spec.Compatible(m); err != nil {
		return false, err.Error()
	}
	if types.value != nil && spec.Value != nil && shape(types.value) != shape(spec.Value) {
		return false, "value fields changed"
	}
	if types.key != nil && spec.Key != nil && shape(types.key) != shape(spec.Key) {
		return false, "key fields changed"
	}
	return true, ""
}

// planMigration reads the record and every pin and decides what becomes
// of each map. It changes nothing; an error means nothing was touched.
func planMigration(cfg Config, specs ...*ebpf.CollectionSpec) (_ *migration, err error) {
	from, recorded, found, err := readLayout(cfg.BPFFSDir)
	if err != nil {
		return nil, err
	}
	version := thisVersion()
	if found && from.Compat > layoutVersion {
		return nil, fmt.Errorf("the pinned data path in %s is layout %d, written by ambient-ebpf %s; this agent, ambient-ebpf %s, has layout %d and cannot take over pins of layout %d or newer: start %s (or a later release) again, or uninstall the data path first",
			cfg.BPFFSDir, from.Layout, cStringOf(from.Version[:]), version, layoutVersion, from.Compat, cStringOf(from.Version[:]))
	}
	if !found {
		from = layoutRecord{Layout: layoutVersion, Compat: layoutCompat}
		bpfobj.CString(from.Version[:], version)
	}
	mig := &migration{from: from, recorded: recorded, byName: map[string]*mapPlan{}}
	mig.to = layoutRecord{Layout: layoutVersion, Compat: layoutCompat}
	bpfobj.CString(mig.to.Version[:], version)
	defer func() {
		if err != nil {
			mig.close()
		}
	}()
	for _, spec := range pinnedSpecs(specs...) {
		p, err := planMap(cfg, spec)
		if err != nil {
			return nil, err
		}
		mig.maps = append(mig.maps, p)
		mig.byName[spec.Name] = p
	}
	entries, _ := os.ReadDir(mapsDir(cfg))
	for _, e := range entries {
		// accel.c's maps are the acceleration's own: it adopts them,
		// creates them when missing and leaves an incompatible one alone
		// (startAccel), so a migration never takes them for the old layout's.
		if mig.byName[e.Name()] == nil && !slices.Contains(accel.MapPins(), e.Name()) {
			mig.obsolete = append(mig.obsolete, e.Name())
		}
	}
	staged, _ := os.ReadDir(filepath.Join(cfg.BPFFSDir, stagingDir))
	for _, e := range staged {
		if p := mig.byName[e.Name()]; p == nil || !p.resume {
			mig.staleStaging = append(mig.staleStaging, e.Name())
		}
	}
	return mig, nil
}

func planMap(cfg Config, spec *ebpf.MapSpec) (*mapPlan, error) {
	p := &mapPlan{spec: spec}
	cur, err := ebpf.LoadPinnedMap(filepath.Join(mapsDir(cfg), spec.Name), nil)
	if errors.Is(err, os.ErrNotExist) {
		p.action = mapCreate
		return p, nil
	}
	if err != nil {
		return nil, fmt.Errorf("open pinned map %s: %w", spec.Name, err)
	}
	types, err := pinnedTypes(cur)
	if err != nil {
		cur.Close()
		return nil, fmt.Errorf("pinned map %s: %w", spec.Name, err)
	}
	same, why := sameLayout(spec, cur, types)
	if same {
		p.action, p.target = mapReuse, cur
		return p, nil
	}
	p.old, p.oldBTF, p.why = cur, types, why
	// A map an agent killed part way staged for this layout is resumed.
	if staged, err := ebpf.LoadPinnedMap(filepath.Join(cfg.BPFFSDir, stagingDir, spec.Name), nil); err == nil {
		st, serr := pinnedTypes(staged)
		if ok, _ := sameLayout(spec, staged, st); serr == nil && ok {
			p.target, p.staged, p.resume = staged, true, true
		} else {
			staged.Close()
		}
	}
	switch {
	case refilled(spec.Name, spec.Type) != "":
		p.action = mapRefill
	case !carried(spec.Type) || !carried(cur.Type()):
		cur.Close()
		if p.target != nil {
			p.target.Close()
		}
		return nil, fmt.Errorf("pinned map %s changed layout (%s), and its entries (%s) cannot be copied from user space: this build cannot migrate it", spec.Name, why, cur.Type())
	default:
		p.action = mapConvert
		if err := p.checkConvertible(); err != nil {
			cur.Close()
			if p.target != nil {
				p.target.Close()
			}
			return nil, fmt.Errorf("pinned map %s changed layout (%s): %w", spec.Name, why, err)
		}
	}
	return p, nil
}

// checkConvertible checks that the old entries can be converted: by BTF,
// or byte for byte where sizes match.
func (p *mapPlan) checkConvertible() error {
	if p.oldBTF.value == nil || p.spec.Value == nil {
		if p.old.ValueSize() != p.spec.ValueSize || p.old.KeySize() != p.spec.KeySize {
			return errors.New("the pinned map has no BTF to convert its entries by")
		}
		return nil
	}
	if err := convertible(p.spec.Value, p.oldBTF.value); err != nil {
		return fmt.Errorf("value: %w", err)
	}
	if p.oldBTF.key != nil && p.spec.Key != nil {
		if err := convertible(p.spec.Key, p.oldBTF.key); err != nil {
			return fmt.Errorf("key: %w", err)
		}
	}
	return nil
}

// prepare creates and fills the maps the new programs will use (steps 1
// and 2) and returns them by collection map name for each spec.
func (m *migration) prepare(cfg Config, log func(msg string, args ...any)) error {
	if m.active() {
		if m.from.State == layoutMigrating {
			// The record of a killed migration names where it came from.
			m.from.Layout, m.from.Version = m.from.FromLayout, m.from.FromVersion
			m.from.State, m.resumed = layoutStable, true
			log("finishing the migration of the pinned data path a stopped agent left", "from_layout", m.from.Layout, "from_version", cStringOf(m.from.Version[:]), "layout", layoutVersion)
		}
		log("migrating the pinned data path", "from_layout", m.from.Layout, "from_version", cStringOf(m.from.Version[:]), "to_layout", layoutVersion, "to_version", cStringOf(m.to.Version[:]))
		rec := m.to
		rec.State, rec.FromLayout, rec.FromVersion = layoutMigrating, m.from.Layout, m.from.Version
		if err := writeLayout(cfg.BPFFSDir, rec); err != nil {
			return err
		}
		cfg.failpoint(StepMigrateJournaled)
	}
	staging := filepath.Join(cfg.BPFFSDir, stagingDir)
	for _, name := range m.staleStaging {
		// A map another layout's agent staged; programs of that agent may
		// still use it until their links are switched below.
		if err := os.Remove(filepath.Join(staging, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove stale staged map %s: %w", name, err)
		}
	}
	for _, p := range m.maps {
		if p.target != nil {
			continue
		}
		dir := mapsDir(cfg)
		if p.action != mapCreate {
			dir, p.staged = staging, true
			if err := os.MkdirAll(staging, 0o700); err != nil {
				return fmt.Errorf("create pin directory: %w", err)
			}
		}
		t, err := ebpf.NewMapWithOptions(p.spec, ebpf.MapOptions{PinPath: dir})
		if err != nil {
			return fmt.Errorf("create map %s: %w", p.name(), err)
		}
		p.target = t
	}
	for _, p := range m.maps {
		if p.action != mapConvert {
			continue
		}
		n, err := p.copy(!p.resume)
		if err != nil {
			return fmt.Errorf("migrate map %s: %w", p.name(), err)
		}
		log("migrated map", "map", p.name(), "entries", n, "change", p.why)
	}
	for _, p := range m.maps {
		if p.action == mapRefill {
			log("map starts empty in the new layout", "map", p.name(), "change", p.why, "why", refilled(p.name(), p.spec.Type))
		}
	}
	if m.active() {
		cfg.failpoint(StepMigrateCopied)
	}
	return nil
}

// replacements are the maps the collection spec cs loads with.
func (m *migration) replacements(cs *ebpf.CollectionSpec) map[string]*ebpf.Map {
	out := map[string]*ebpf.Map{}
	for k, ms := range cs.Maps {
		if p := m.byName[ms.Name]; p != nil && ms.Pinning == ebpf.PinByName {
			out[k] = p.target
		}
	}
	return out
}

// copy copies every entry of the old map into the target, converted.
// overwrite false keeps what the target has (a resumed or second pass:
// the new programs may have written it since).
func (p *mapPlan) copy(overwrite bool) (int, error) {
	perCPU := p.old.Type() == ebpf.PerCPUHash || p.old.Type() == ebpf.PerCPUArray || p.old.Type() == ebpf.LRUCPUHash
	isArray := p.old.Type() == ebpf.Array || p.old.Type() == ebpf.PerCPUArray
	if isArray && !overwrite {
		return 0, nil // every index exists in an array: nothing is missing
	}
	flags := ebpf.UpdateAny
	if !overwrite {
		flags = ebpf.UpdateNoExist
	}
	key := make([]byte, p.old.KeySize())
	var prev any // nil: the first key
	n := 0
	for {
		if err := p.old.NextKey(prev, &key); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return n, nil
			}
			return n, fmt.Errorf("iterate: %w", err)
		}
		prev = slices.Clone(key)
		newKey, err := p.convertKey(key)
		if err != nil {
			return n, err
		}
		if perCPU {
			var vals [][]byte
			if err := p.old.Lookup(key, &vals); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					continue // deleted meanwhile
				}
				return n, fmt.Errorf("lookup: %w", err)
			}
			out := make([][]byte, len(vals))
			for i, v := range vals {
				if out[i], err = p.convertValue(v); err != nil {
					return n, err
				}
			}
			err = p.target.Update(newKey, out, flags)
		} else {
			var v []byte
			if err := p.old.Lookup(key, &v); err != nil {
				if errors.Is(err, ebpf.ErrKeyNotExist) {
					continue
				}
				return n, fmt.Errorf("lookup: %w", err)
			}
			nv, cerr := p.convertValue(v)
			if cerr != nil {
				return n, cerr
			}
			err = p.target.Update(newKey, nv, flags)
		}
		if err != nil && !(errors.Is(err, ebpf.ErrKeyExist) && !overwrite) {
			return n, fmt.Errorf("update: %w", err)
		}
		if err == nil {
			n++
		}
	}
}

func (p *mapPlan) convertValue(v []byte) ([]byte, error) {
	if p.oldBTF.value == nil || p.spec.Value == nil {
		return v, nil
	}
	return convert(p.spec.Value, p.oldBTF.value, v[:p.old.ValueSize()])
}

func (p *mapPlan) convertKey(k []byte) ([]byte, error) {
	if p.oldBTF.key == nil || p.spec.Key == nil {
		return k, nil
	}
	return convert(p.spec.Key, p.oldBTF.key, k)
}

// finish runs after every link was switched to the new programs (steps 3
// and 4): entries the old programs made meanwhile are copied, the new maps
// take the old pins' places, old maps and node links this build does not
// have are removed, and the record says "stable".
func (m *migration) finish(cfg Config, nodeHooks []string, log func(msg string, args ...any)) error {
	if !m.active() {
		if !m.recorded || m.from != m.to {
			return writeLayout(cfg.BPFFSDir, m.to)
		}
		return nil
	}
	cfg.failpoint(StepMigrateSwitched)
	for _, p := range m.maps {
		if p.action != mapConvert {
			continue
		}
		n, err := p.copy(false)
		if err != nil {
			return fmt.Errorf("migrate map %s: %w", p.name(), err)
		}
		if n > 0 {
			log("migrated entries made while the links were switched", "map", p.name(), "entries", n)
		}
	}
	for _, p := range m.maps {
		if !p.staged {
			continue
		}
		// rename(2) replaces the old pin in one step: maps/<name> always
		// names a map.
		if err := os.Rename(filepath.Join(cfg.BPFFSDir, stagingDir, p.name()), filepath.Join(mapsDir(cfg), p.name())); err != nil {
			return fmt.Errorf("move map %s in place: %w", p.name(), err)
		}
	}
	for _, name := range m.obsolete {
		log("removing a map of the old layout", "map", name)
		if err := os.Remove(filepath.Join(mapsDir(cfg), name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove map %s: %w", name, err)
		}
	}
	links, _ := os.ReadDir(linksDir(cfg))
	for _, e := range links {
		if slices.Contains(nodeHooks, e.Name()) || e.Name() == accel.SockopsPin || e.Name() == accel.MsgPin {
			continue // the node's hooks, and the acceleration's (startAccel)
		}
		log("removing a node link of the old layout", "link", e.Name())
		if err := removePinnedLink(filepath.Join(linksDir(cfg), e.Name())); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(filepath.Join(cfg.BPFFSDir, stagingDir)); err != nil {
		return fmt.Errorf("remove %s: %w", stagingDir, err)
	}
	cfg.failpoint(StepMigratePinned)
	if err := writeLayout(cfg.BPFFSDir, m.to); err != nil {
		return err
	}
	log("migrated the pinned data path", "from_layout", m.from.Layout, "from_version", cStringOf(m.from.Version[:]), "layout", layoutVersion, "version", cStringOf(m.to.Version[:]))
	return nil
}

// removePinnedLink detaches the link pinned at pin and removes the pin; a
// pin that is no link is only removed.
func removePinnedLink(pin string) error {
	if l, err := link.LoadPinnedLink(pin, nil); err == nil {
		_ = l.Detach()
		_ = l.Unpin()
		l.Close()
	}
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", pin, err)
	}
	return nil
}

// ReadLayout returns the layout of the pins under bpffsDir: the record,
// or layout 1 without one (v0.1.0 wrote none); ErrNotInstalled without
// pins.
func ReadLayout(bpffsDir string) (Layout, error) {
	rec, recorded, found, err := readLayout(bpffsDir)
	if err != nil {
		return Layout{}, err
	}
	if !found {
		return Layout{}, fmt.Errorf("%s: %w", bpffsDir, ErrNotInstalled)
	}
	return rec.public(recorded), nil
}
