// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package upgrade

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// The steps of an upgrade. The pins carry a record of their layout
// (<root>/ae_layout, read before anything is loaded); pins without one were
// written by v0.1.0, layout 1. When the pinned layout is not this build's,
// the runtime's start upgrades it (to an older layout too: a downgrade is
// an upgrade the other way):
//
//  1. The record says "upgrading" to this layout (from the old one); a
//     pinned layout this build cannot take over (its compat layout is
//     newer than ours) is refused before this, nothing touched.
//  2. Each map whose pinned layout differs gets a new map pinned under
//     <root>/next/, filled from the old one (converted field by field,
//     convert_linux.go). Unchanged maps are used as they are, with their
//     entries and sockets; a new map starts empty under maps/.
//  3. The runtime loads the programs on the new maps and switches every
//     link to them in place (link update, tc filter replace): each hook
//     runs either the old programs on the old maps or the new ones on
//     filled new maps, never a program on an empty map.
//  4. Entries the old programs made while the links were switched are
//     copied too, the new maps replace the old pins (rename), old maps and
//     links this build does not have are removed, and the record says
//     "stable".
//
// Each step can be killed: the next agent, of this layout or the old one,
// plans again from what the pins are (a staged map of its layout is
// resumed, one of another layout replaced) and finishes.

// Steps are the upgrade's failpoints (Config.Failpoint), in order.
var Steps = []string{StepJournaled, StepCopied, StepSwitched, StepPinned}

// The failpoints: after each, a killed agent leaves pins the next one
// finishes the upgrade of.
const (
	StepJournaled = "upgrade/journaled" // the record says upgrading; nothing else changed
	StepCopied    = "upgrade/copied"    // new maps pinned under next/ and filled; no program uses them
	StepSwitched  = "upgrade/switched"  // every link runs the new programs; old maps still pinned
	StepPinned    = "upgrade/pinned"    // new maps under maps/, old pins gone; the record not yet stable
)

// Config is what the runtime hands an upgrade.
type Config struct {
	// BPFFSDir is the pin directory, the runtime's.
	BPFFSDir string
	// ForeignMaps are pins under maps/ that no spec has and that stay
	// (the sockmap acceleration's: it adopts its own maps).
	ForeignMaps []string
	// Links are the pins under links/ the runtime keeps (its node hooks,
	// the acceleration's); Finish removes every other one.
	Links  []string
	Logger *slog.Logger
	// Failpoint, when set, is called at each of Steps; the
	// crash-injection tests kill the process there.
	Failpoint func(step string)
}

func (c *Config) failpoint(step string) {
	if c.Failpoint != nil {
		c.Failpoint(step)
	}
}

// What becomes of one pinned map.
const (
	mapReuse   = iota // the pin has this build's layout: used as it is
	mapCreate         // no pin: a new, empty map
	mapConvert        // another layout: a new map, filled from the old one
	mapRefill         // another layout, entries that refill themselves: a new, empty map
)

// mapPlan is one pinned map of this build and what the upgrade does with it.
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

// Plan is what an upgrade found of the pins' layout and does about it,
// from Prepare until Finish; Close releases its maps. On pins of this
// build's layout it only writes the record where that is missing or names
// another build.
type Plan struct {
	cfg          Config
	from, to     layoutRecord
	recorded     bool
	resumed      bool // a killed agent's upgrade is being finished
	maps         []*mapPlan
	byName       map[string]*mapPlan
	staleStaging []string // pins under next/ of another layout
	obsolete     []string // pins under maps/ this build has no map for
}

// Active reports whether the pins change layout, or an upgrade is to be
// finished.
func (m *Plan) Active() bool {
	if m.from.Layout != m.to.Layout || m.from.State == layoutUpgrading || m.resumed || len(m.staleStaging) > 0 || len(m.obsolete) > 0 {
		return true
	}
	for _, p := range m.maps {
		if p.action == mapConvert || p.action == mapRefill {
			return true
		}
	}
	return false
}

// Close releases the maps the plan holds; the pins stay.
func (m *Plan) Close() {
	if m == nil {
		return
	}
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

// Prepare plans the upgrade of the pins to the layout of specs (the
// collections the runtime will load) and, where the layout changes,
// carries out steps 1 and 2: the record says upgrading and each changed
// map has a filled new one under next/. Every map a program of specs will
// use exists and is filled when it returns. On an error it holds nothing.
func Prepare(cfg Config, specs ...*ebpf.CollectionSpec) (*Plan, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m, err := plan(cfg, specs...)
	if err != nil {
		return nil, err
	}
	if err := m.prepare(); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// plan reads the record and every pin and decides what becomes of each
// map. It changes nothing; an error means nothing was touched.
func plan(cfg Config, specs ...*ebpf.CollectionSpec) (_ *Plan, err error) {
	from, recorded, found, err := readLayout(cfg.BPFFSDir)
	if err != nil {
		return nil, err
	}
	version := thisVersion()
	if found && from.Compat > layoutVersion {
		return nil, refusal(cfg.BPFFSDir, from)
	}
	if !found {
		from = layoutRecord{Layout: layoutVersion, Compat: layoutCompat}
		bpfobj.CString(from.Version[:], version)
	}
	up := &Plan{cfg: cfg, from: from, recorded: recorded, byName: map[string]*mapPlan{}}
	up.to = layoutRecord{Layout: layoutVersion, Compat: layoutCompat}
	bpfobj.CString(up.to.Version[:], version)
	defer func() {
		if err != nil {
			up.Close()
		}
	}()
	for _, spec := range pinnedSpecs(specs...) {
		p, err := planMap(cfg, spec)
		if err != nil {
			return nil, err
		}
		up.maps = append(up.maps, p)
		up.byName[spec.Name] = p
	}
	entries, _ := os.ReadDir(bpfobj.MapsDir(cfg.BPFFSDir))
	for _, e := range entries {
		// Foreign maps are another owner's (the acceleration adopts its
		// own, creates them when missing and leaves an incompatible one
		// alone), so an upgrade never takes them for the old layout's.
		if up.byName[e.Name()] == nil && !slices.Contains(cfg.ForeignMaps, e.Name()) {
			up.obsolete = append(up.obsolete, e.Name())
		}
	}
	staged, _ := os.ReadDir(filepath.Join(cfg.BPFFSDir, StagingDir))
	for _, e := range staged {
		if p := up.byName[e.Name()]; p == nil || !p.resume {
			up.staleStaging = append(up.staleStaging, e.Name())
		}
	}
	return up, nil
}

func planMap(cfg Config, spec *ebpf.MapSpec) (*mapPlan, error) {
	p := &mapPlan{spec: spec}
	cur, err := ebpf.LoadPinnedMap(filepath.Join(bpfobj.MapsDir(cfg.BPFFSDir), spec.Name), nil)
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
	if staged, err := ebpf.LoadPinnedMap(filepath.Join(cfg.BPFFSDir, StagingDir, spec.Name), nil); err == nil {
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
// and 2).
func (m *Plan) prepare() error {
	cfg, log := &m.cfg, m.cfg.Logger.Info
	if m.Active() {
		if m.from.State == layoutUpgrading {
			// The record of a killed upgrade names where it came from.
			m.from.Layout, m.from.Version = m.from.FromLayout, m.from.FromVersion
			m.from.State, m.resumed = layoutStable, true
			log("finishing the migration of the pinned data path a stopped agent left", "from_layout", m.from.Layout, "from_version", bpfobj.GoString(m.from.Version[:]), "layout", layoutVersion)
		}
		log("migrating the pinned data path", "from_layout", m.from.Layout, "from_version", bpfobj.GoString(m.from.Version[:]), "to_layout", layoutVersion, "to_version", bpfobj.GoString(m.to.Version[:]))
		rec := m.to
		rec.State, rec.FromLayout, rec.FromVersion = layoutUpgrading, m.from.Layout, m.from.Version
		if err := writeLayout(cfg.BPFFSDir, rec); err != nil {
			return err
		}
		cfg.failpoint(StepJournaled)
	}
	staging := filepath.Join(cfg.BPFFSDir, StagingDir)
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
		dir := bpfobj.MapsDir(cfg.BPFFSDir)
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
	if m.Active() {
		cfg.failpoint(StepCopied)
	}
	return nil
}

// Map is the map the programs will use for the pin name, nil when no
// spec has it. A loader writes a data section's contents only into a map
// it creates itself: the runtime writes those of a replaced one here.
func (m *Plan) Map(name string) *ebpf.Map {
	if p := m.byName[name]; p != nil {
		return p.target
	}
	return nil
}

// Replacements are the maps the collection spec cs loads with
// (CollectionOptions.MapReplacements): every map it pins by name.
func (m *Plan) Replacements(cs *ebpf.CollectionSpec) map[string]*ebpf.Map {
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

// Finish runs after the runtime switched every link to the new programs
// (step 3) and carries out step 4: entries the old programs made meanwhile
// are copied, the new maps take the old pins' places, old maps and the
// links under links/ that Config.Links does not name are removed, and the
// record says "stable".
func (m *Plan) Finish() error {
	cfg, log := &m.cfg, m.cfg.Logger.Info
	if !m.Active() {
		if !m.recorded || m.from != m.to {
			return writeLayout(cfg.BPFFSDir, m.to)
		}
		return nil
	}
	cfg.failpoint(StepSwitched)
	staging, maps := filepath.Join(cfg.BPFFSDir, StagingDir), bpfobj.MapsDir(cfg.BPFFSDir)
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
		if err := os.Rename(filepath.Join(staging, p.name()), filepath.Join(maps, p.name())); err != nil {
			return fmt.Errorf("move map %s in place: %w", p.name(), err)
		}
	}
	for _, name := range m.obsolete {
		log("removing a map of the old layout", "map", name)
		if err := os.Remove(filepath.Join(maps, name)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove map %s: %w", name, err)
		}
	}
	links := bpfobj.LinksDir(cfg.BPFFSDir)
	entries, _ := os.ReadDir(links)
	for _, e := range entries {
		if slices.Contains(cfg.Links, e.Name()) {
			continue // the node's hooks, and the acceleration's
		}
		log("removing a node link of the old layout", "link", e.Name())
		if err := removePinnedLink(filepath.Join(links, e.Name())); err != nil {
			return err
		}
	}
	if err := os.RemoveAll(staging); err != nil {
		return fmt.Errorf("remove %s: %w", StagingDir, err)
	}
	cfg.failpoint(StepPinned)
	if err := writeLayout(cfg.BPFFSDir, m.to); err != nil {
		return err
	}
	log("migrated the pinned data path", "from_layout", m.from.Layout, "from_version", bpfobj.GoString(m.from.Version[:]), "layout", layoutVersion, "version", bpfobj.GoString(m.to.Version[:]))
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
