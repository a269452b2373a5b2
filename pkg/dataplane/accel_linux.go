// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
)

// The sockmap acceleration (Config.SockmapAccel, bpf/accel.c) adds to the
// pinned layout:
//
//	maps/ae_accel        ends whose sends are redirected (sockhash, by cookie)
//	maps/ae_accel_rx     ends that are redirected to (sockhash, by cookie)
//	maps/ae_accel_pair   connections by their connecting end's 4-tuple:
//	                     who the two ends are
//	maps/ae_accel_sk     each end's cookie, peer and decision (socket storage)
//	maps/ae_accel_stats  its counters (per CPU)
//	links/accel_sockops  the sockops program that fills ae_accel, on the
//	                     node's cgroup root beside links/sockops
//	links/accel_msg      the sk_msg program on ae_accel (Linux 6.10+; before,
//	                     the program is attached to the map itself, which
//	                     holds it as long as the pinned map lives)
//
// Turning the flag off removes links/accel_sockops, so no new hop is
// accelerated (and the connections still open leave their ae_accel_pair
// entries behind: their close no longer runs the program; the entries go
// with the maps). Sockets already in ae_accel keep their program until they
// close: taking a socket out of a sockhash would drop what was redirected
// to it and not yet read. The map and the program go once it is empty
// (checked at each start with the flag off).
const (
	accelSockopsPin = "accel_sockops"
	accelMsgPin     = "accel_msg"
)

// accelMapPins are the pins of accel.c's own maps.
var accelMapPins = []string{accelMapAeAccel, accelMapAeAccelRx, accelMapAeAccelPair, accelMapAeAccelSk, accelMapAeAccelStats}

// AccelStatus says whether the sockmap acceleration runs, and why not.
type AccelStatus struct {
	// Mode is Config.SockmapAccel.
	Mode AccelMode `json:"mode"`
	// Active: new hops are accelerated.
	Active bool `json:"active"`
	// Reason says why a requested acceleration is not active.
	Reason string `json:"reason,omitempty"`
	// Attach is how the sk_msg program is attached: "link" (a pinned
	// bpf_link, Linux 6.10+) or "map" (BPF_PROG_ATTACH to the sockhash).
	Attach string `json:"attach,omitempty"`
}

// accelState is the loaded acceleration: its programs and maps, and the
// links the agent holds (pinned).
type accelState struct {
	objs    accelObjects
	sockops link.Link
	msg     link.Link // nil where the program is attached to the map
}

func (a *accelState) close() {
	if a.sockops != nil {
		a.sockops.Close()
	}
	if a.msg != nil {
		a.msg.Close()
	}
	a.objs.Close()
}

// AccelStatus reports the sockmap acceleration's state.
func (d *Dataplane) AccelStatus() AccelStatus {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.accelStatus
}

// setupAccel starts, adopts or stops the sockmap acceleration as the
// configuration asks. It never fails New: without it the hop is TCP, as
// it is without the flag; why is logged and kept in AccelStatus.
func (d *Dataplane) setupAccel(cgroupID uint64) {
	d.accelStatus = AccelStatus{Mode: d.cfg.SockmapAccel}
	if !d.cfg.SockmapAccel.On() {
		d.stopAccel()
		return
	}
	if !features.HasSockmapAccel() {
		d.accelStatus.Reason = "the kernel lacks bpf_get_netns_cookie in sockops and sk_msg programs (Linux 5.15)"
		d.log.Warn("sockmap acceleration requested but not available: the app <-> ztunnel hop stays on TCP", "reason", d.accelStatus.Reason)
		return
	}
	a, err := d.startAccel(cgroupID)
	if err != nil {
		d.accelStatus.Reason = err.Error()
		d.log.Warn("sockmap acceleration could not start: the app <-> ztunnel hop stays on TCP", "error", err)
		return
	}
	d.accel = a
	d.accelStatus.Active = true
	d.accelStatus.Attach = "map"
	if a.msg != nil {
		d.accelStatus.Attach = "link"
	}
	d.log.Info("sockmap acceleration on", "mode", d.cfg.SockmapAccel, "attach", d.accelStatus.Attach)
}

// startAccel loads accel.c (its maps pinned by name), attaches the sk_msg
// program to ae_accel and then the sockops program to the cgroup root, so
// no socket enters the map before the program that serves it. Pins of an
// earlier agent are adopted: their programs are replaced in place. On
// error, what this call created is removed.
func (d *Dataplane) startAccel(cgroupID uint64) (*accelState, error) {
	var fresh []string // map pins this call creates
	for _, name := range accelMapPins {
		if _, err := os.Stat(filepath.Join(mapsDir(d.cfg), name)); errors.Is(err, os.ErrNotExist) {
			fresh = append(fresh, filepath.Join(mapsDir(d.cfg), name))
		}
	}
	spec, err := loadAccel()
	if err != nil {
		return nil, fmt.Errorf("read sockmap programs: %w", err)
	}
	var as accelSpecs
	if err := spec.Assign(&as); err != nil {
		return nil, fmt.Errorf("read sockmap programs: %w", err)
	}
	cfg := d.cfg.bpfConfig()
	cfg.Flags = d.bpfFlags
	if err := as.AeCfg.Set(cfg); err != nil {
		return nil, fmt.Errorf("configure sockmap programs: %w", err)
	}
	intoApp := uint32(0)
	if d.cfg.SockmapAccel == AccelBoth {
		intoApp = 1
	}
	if err := as.AccelIntoApp.Set(intoApp); err != nil {
		return nil, fmt.Errorf("configure sockmap programs: %w", err)
	}
	a := &accelState{}
	if err := spec.LoadAndAssign(&a.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: mapsDir(d.cfg)}}); err != nil {
		d.logVerifier(err)
		removePins(fresh)
		return nil, fmt.Errorf("load sockmap programs: %w", err)
	}
	var created []string // link pins this call creates
	rollback := func() {
		a.close()
		removePins(created)
		removePins(fresh)
	}
	msgPin := filepath.Join(linksDir(d.cfg), accelMsgPin)
	if len(fresh) > 0 {
		// A link pin that outlived its map (removed by hand) would update
		// the old map's program.
		removePins([]string{msgPin})
	}
	if features.HasSockmapLink() {
		l, made, err := adoptOrLink(msgPin, func() (link.Link, error) {
			return link.AttachRawLink(link.RawLinkOptions{Target: a.objs.AeAccel.FD(), Program: a.objs.AeAccelMsg, Attach: ebpf.AttachSkMsgVerdict})
		}, a.objs.AeAccelMsg)
		if err != nil {
			rollback()
			return nil, fmt.Errorf("attach sk_msg program to ae_accel: %w", err)
		}
		a.msg = l
		if made {
			created = append(created, msgPin)
		}
	} else {
		// Before 6.10 a sockmap program cannot be linked: attached to the
		// map, it is the map's until replaced or the map is freed.
		// Attaching again replaces an earlier agent's program.
		if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: a.objs.AeAccel.FD(), Program: a.objs.AeAccelMsg, Attach: ebpf.AttachSkMsgVerdict}); err != nil {
			rollback()
			return nil, fmt.Errorf("attach sk_msg program to ae_accel: %w", err)
		}
	}
	sockopsPin := filepath.Join(linksDir(d.cfg), accelSockopsPin)
	l, made, err := adoptOrLink(sockopsPin, func() (link.Link, error) {
		return link.AttachCgroup(link.CgroupOptions{Path: d.cfg.CgroupRoot, Attach: ebpf.AttachCGroupSockOps, Program: a.objs.AeAccelSockops})
	}, a.objs.AeAccelSockops)
	if err == nil && !made {
		if err = sameCgroup(l, cgroupID); err != nil {
			l.Close()
		}
	}
	if err != nil {
		rollback()
		return nil, fmt.Errorf("attach sockmap sockops to cgroup %s: %w", d.cfg.CgroupRoot, err)
	}
	a.sockops = l
	return a, nil
}

// adoptOrLink loads the link pinned at pin and swaps prog into it, or
// makes one with attach and pins it (made).
func adoptOrLink(pin string, attach func() (link.Link, error), prog *ebpf.Program) (l link.Link, made bool, err error) {
	l, err = link.LoadPinnedLink(pin, nil)
	switch {
	case err == nil:
		if err := l.Update(prog); err != nil {
			l.Close()
			return nil, false, fmt.Errorf("update pinned link %s: %w", pin, err)
		}
		return l, false, nil
	case errors.Is(err, os.ErrNotExist):
		if l, err = attach(); err != nil {
			return nil, false, err
		}
		if err := l.Pin(pin); err != nil {
			l.Close()
			return nil, false, fmt.Errorf("pin %s: %w", pin, err)
		}
		return l, true, nil
	}
	return nil, false, fmt.Errorf("load pinned link %s: %w", pin, err)
}

// stopAccel is the flag off: no new hop is accelerated; the maps and the
// sk_msg program stay while sockets are in ae_accel (see the layout above).
func (d *Dataplane) stopAccel() {
	pin := filepath.Join(linksDir(d.cfg), accelSockopsPin)
	if err := detachPinnedLink(pin); err != nil {
		d.log.Warn("sockmap acceleration off: cannot detach its sockops program", "pin", pin, "error", err)
		return
	}
	info, err := ReadAccel(d.cfg.BPFFSDir)
	if err != nil {
		d.log.Warn("sockmap acceleration off: cannot read its maps", "error", err)
		return
	}
	if !info.Installed {
		return
	}
	if n := info.Senders + info.Receivers; n > 0 {
		d.log.Info("sockmap acceleration off: accelerated connections keep it until they close", "map_entries", n)
		return
	}
	if err := detachPinnedLink(filepath.Join(linksDir(d.cfg), accelMsgPin)); err != nil {
		d.log.Warn("sockmap acceleration off: cannot detach its sk_msg program", "error", err)
		return
	}
	for _, name := range accelMapPins {
		removePins([]string{filepath.Join(mapsDir(d.cfg), name)})
	}
	d.log.Info("sockmap acceleration removed")
}

// uninstallAccel removes the acceleration's link pins (Uninstall removes
// the map pins with the directory). Accelerated connections keep their
// program, which keeps the map, until they close.
func (d *Dataplane) uninstallAccel() error {
	var errs []error
	for _, name := range []string{accelSockopsPin, accelMsgPin} {
		if err := detachPinnedLink(filepath.Join(linksDir(d.cfg), name)); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// detachPinnedLink detaches the link pinned at pin and removes the pin;
// a missing pin is no error.
func detachPinnedLink(pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close()
	if err := l.Detach(); err != nil && !errors.Is(err, ebpf.ErrNotSupported) {
		return fmt.Errorf("detach %s: %w", pin, err)
	}
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin %s: %w", pin, err)
	}
	return nil
}

func removePins(pins []string) {
	for _, p := range pins {
		_ = os.Remove(p)
	}
}

// countKeys counts a map's entries by walking its keys (a sockhash's
// values cannot be dumped in bulk by every kernel).
func countKeys(m *ebpf.Map) (int, error) {
	key := make([]byte, m.KeySize())
	next := make([]byte, m.KeySize())
	n := 0
	var prev any
	for {
		if err := m.NextKey(prev, next); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return n, nil
			}
			return n, err
		}
		n++
		copy(key, next)
		prev = key
	}
}

// countPinned counts the entries of the map pinned at pin.
func countPinned(pin string) (int, error) {
	m, err := ebpf.LoadPinnedMap(pin, &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return 0, fmt.Errorf("open %s: %w", pin, err)
	}
	defer m.Close()
	n, err := countKeys(m)
	if err != nil {
		return n, fmt.Errorf("read %s: %w", pin, err)
	}
	return n, nil
}

// AccelInfo is the sockmap acceleration as the pins show it.
type AccelInfo struct {
	// Installed: maps/ae_accel exists.
	Installed bool `json:"installed"`
	// Active: links/accel_sockops exists, so new hops are accelerated.
	Active bool `json:"active"`
	// Sockets in ae_accel (sending ends) and ae_accel_rx (receiving) now.
	Senders   int        `json:"senders"`
	Receivers int        `json:"receivers"`
	Stats     AccelStats `json:"stats"`
}

// AccelStats are the acceleration's counters, summed over CPUs.
type AccelStats struct {
	Sockets       uint64 `json:"sockets"`       // sockets put into ae_accel or ae_accel_rx
	InsertErrors  uint64 `json:"insertErrors"`  // sockets the kernel refused (MPTCP, kTLS, full)
	Unpaired      uint64 `json:"unpaired"`      // accepted sockets with no proven connecting end
	Redirecting   uint64 `json:"redirecting"`   // ends whose peer was in at their first send
	Plain         uint64 `json:"plain"`         // ends whose peer was not: TCP for good
	RedirectMsgs  uint64 `json:"redirectMsgs"`  // sends handed to the peer socket
	RedirectBytes uint64 `json:"redirectBytes"` // their bytes
	PassMsgs      uint64 `json:"passMsgs"`      // sends that went through TCP
	PeerGone      uint64 `json:"peerGone"`      // sends whose peer had closed
}

// ReadAccel reads the acceleration's pins under bpffsDir (Config.BPFFSDir).
func ReadAccel(bpffsDir string) (AccelInfo, error) {
	var info AccelInfo
	if _, err := os.Stat(filepath.Join(bpffsDir, "links", accelSockopsPin)); err == nil {
		info.Active = true
	}
	ro := &ebpf.LoadPinOptions{ReadOnly: true}
	if _, err := os.Stat(filepath.Join(bpffsDir, "maps", accelMapAeAccel)); errors.Is(err, os.ErrNotExist) {
		return info, nil
	}
	info.Installed = true
	var err error
	if info.Senders, err = countPinned(filepath.Join(bpffsDir, "maps", accelMapAeAccel)); err != nil {
		return info, err
	}
	if info.Receivers, err = countPinned(filepath.Join(bpffsDir, "maps", accelMapAeAccelRx)); err != nil {
		return info, err
	}
	sm, err := ebpf.LoadPinnedMap(filepath.Join(bpffsDir, "maps", accelMapAeAccelStats), ro)
	if err != nil {
		return info, fmt.Errorf("open ae_accel_stats: %w", err)
	}
	defer sm.Close()
	perCPU := make([]accelAccelStats, ebpf.MustPossibleCPU())
	if err := sm.Lookup(uint32(0), &perCPU); err != nil {
		return info, fmt.Errorf("read ae_accel_stats: %w", err)
	}
	for _, c := range perCPU {
		info.Stats.Sockets += c.Sockets
		info.Stats.InsertErrors += c.InsertErrors
		info.Stats.Unpaired += c.Unpaired
		info.Stats.Redirecting += c.Redirecting
		info.Stats.Plain += c.Plain
		info.Stats.RedirectMsgs += c.RedirectMsgs
		info.Stats.RedirectBytes += c.RedirectBytes
		info.Stats.PassMsgs += c.PassMsgs
		info.Stats.PeerGone += c.PeerGone
	}
	return info, nil
}
