// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package accel

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
)

// Link pins of the acceleration (see the package doc).
const (
	SockopsPin = "accel_sockops"
	MsgPin     = "accel_msg"
)

// MapPins are the pins of accel.c's own maps.
func MapPins() []string {
	return []string{accelMapAeAccel, accelMapAeAccelRx, accelMapAeAccelPair, accelMapAeAccelSk, accelMapAeAccelStats}
}

// Status says whether the sockmap acceleration runs, and why not.
type Status struct {
	// Mode is the mode asked for.
	Mode Mode `json:"mode"`
	// Active: new hops are accelerated.
	Active bool `json:"active"`
	// Reason says why a requested acceleration is not active.
	Reason string `json:"reason,omitempty"`
	// Attach is how the sk_msg program is attached: "link" (a pinned
	// bpf_link, Linux 6.10+) or "map" (BPF_PROG_ATTACH to the sockhash).
	Attach string `json:"attach,omitempty"`
}

// Options is what Setup needs of the runtime.
type Options struct {
	Mode Mode
	// BPFFSDir is the agent's pin directory; CgroupRoot the cgroup v2
	// root the node-wide hooks are on, and CgroupID its id.
	BPFFSDir   string
	CgroupRoot string
	CgroupID   uint64
	// Config is the node-wide ae_cfg the other objects were loaded with.
	Config bpfobj.SockAeConfig
	Log    *slog.Logger
	// KernelBTF is the kernel's BTF as the caller's other loads decoded
	// it (nil: decoded again).
	KernelBTF *btf.Cache
}

// Accel is the loaded acceleration: its programs and maps, and the links
// the agent holds (pinned).
type Accel struct {
	objs    accelObjects
	sockops link.Link
	msg     link.Link // nil where the program is attached to the map
}

// Close releases the agent's handles; the pins keep the acceleration.
func (a *Accel) Close() {
	if a == nil {
		return
	}
	if a.sockops != nil {
		a.sockops.Close()
	}
	if a.msg != nil {
		a.msg.Close()
	}
	a.objs.Close()
}

// Setup starts, adopts or stops the sockmap acceleration as o.Mode asks.
// It never fails: without it the hop is TCP, as it is without the flag;
// why is logged and kept in the Status. The Accel is nil unless active.
func Setup(o Options) (*Accel, Status) {
	st := Status{Mode: o.Mode}
	if !o.Mode.On() {
		stop(o.BPFFSDir, o.Log)
		return nil, st
	}
	if !features.HasSockmapAccel() {
		st.Reason = "the kernel lacks bpf_get_netns_cookie in sockops and sk_msg programs (Linux 5.15)"
		o.Log.Warn("sockmap acceleration requested but not available: the app <-> ztunnel hop stays on TCP", "reason", st.Reason)
		return nil, st
	}
	a, err := start(o)
	if err != nil {
		st.Reason = err.Error()
		var ve *ebpf.VerifierError
		if errors.As(err, &ve) {
			o.Log.Error("verifier rejected a program", "log", fmt.Sprintf("%+v", ve))
		}
		o.Log.Warn("sockmap acceleration could not start: the app <-> ztunnel hop stays on TCP", "error", err)
		return nil, st
	}
	st.Active, st.Attach = true, "map"
	if a.msg != nil {
		st.Attach = "link"
	}
	o.Log.Info("sockmap acceleration on", "mode", o.Mode, "attach", st.Attach)
	return a, st
}

// start loads accel.c (its maps pinned by name), attaches the sk_msg
// program to ae_accel and then the sockops program to the cgroup root, so
// no socket enters the map before the program that serves it. Pins of an
// earlier agent are adopted: their programs are replaced in place. On
// error, what this call created is removed.
func start(o Options) (*Accel, error) {
	var fresh []string // map pins this call creates
	for _, name := range MapPins() {
		if _, err := os.Stat(filepath.Join(bpfobj.MapsDir(o.BPFFSDir), name)); errors.Is(err, os.ErrNotExist) {
			fresh = append(fresh, filepath.Join(bpfobj.MapsDir(o.BPFFSDir), name))
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
	if err := as.AeCfg.Set(o.Config); err != nil {
		return nil, fmt.Errorf("configure sockmap programs: %w", err)
	}
	intoApp := uint32(0)
	if o.Mode == Both {
		intoApp = 1
	}
	if err := as.AccelIntoApp.Set(intoApp); err != nil {
		return nil, fmt.Errorf("configure sockmap programs: %w", err)
	}
	a := &Accel{}
	if err := spec.LoadAndAssign(&a.objs, &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: bpfobj.MapsDir(o.BPFFSDir)}, Cache: o.KernelBTF}); err != nil {
		removePins(fresh)
		return nil, fmt.Errorf("load sockmap programs: %w", err)
	}
	var created []string // link pins this call creates
	rollback := func() {
		a.Close()
		removePins(created)
		removePins(fresh)
	}
	msgPin := filepath.Join(bpfobj.LinksDir(o.BPFFSDir), MsgPin)
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
	sockopsPin := filepath.Join(bpfobj.LinksDir(o.BPFFSDir), SockopsPin)
	l, made, err := adoptOrLink(sockopsPin, func() (link.Link, error) {
		return link.AttachCgroup(link.CgroupOptions{Path: o.CgroupRoot, Attach: ebpf.AttachCGroupSockOps, Program: a.objs.AeAccelSockops})
	}, a.objs.AeAccelSockops)
	if err == nil && !made {
		if err = bpfobj.SameCgroup(l, o.CgroupID); err != nil {
			l.Close()
		}
	}
	if err != nil {
		rollback()
		return nil, fmt.Errorf("attach sockmap sockops to cgroup %s: %w", o.CgroupRoot, err)
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

// stop is the flag off: no new hop is accelerated; the maps and the
// sk_msg program stay while sockets are in ae_accel (see the layout above).
func stop(bpffsDir string, log *slog.Logger) {
	pin := filepath.Join(bpfobj.LinksDir(bpffsDir), SockopsPin)
	if err := detachPinnedLink(pin); err != nil {
		log.Warn("sockmap acceleration off: cannot detach its sockops program", "pin", pin, "error", err)
		return
	}
	info, err := Read(bpffsDir)
	if err != nil {
		log.Warn("sockmap acceleration off: cannot read its maps", "error", err)
		return
	}
	if !info.Installed {
		return
	}
	if n := info.Senders + info.Receivers; n > 0 {
		log.Info("sockmap acceleration off: accelerated connections keep it until they close", "map_entries", n)
		return
	}
	if err := detachPinnedLink(filepath.Join(bpfobj.LinksDir(bpffsDir), MsgPin)); err != nil {
		log.Warn("sockmap acceleration off: cannot detach its sk_msg program", "error", err)
		return
	}
	for _, name := range MapPins() {
		removePins([]string{filepath.Join(bpfobj.MapsDir(bpffsDir), name)})
	}
	log.Info("sockmap acceleration removed")
}

// Uninstall removes the acceleration's link pins (the runtime's Uninstall
// removes the map pins with the directory). Accelerated connections keep
// their program, which keeps the map, until they close.
func Uninstall(bpffsDir string) error {
	var errs []error
	for _, name := range []string{SockopsPin, MsgPin} {
		if err := detachPinnedLink(filepath.Join(bpfobj.LinksDir(bpffsDir), name)); err != nil {
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

// Info is the sockmap acceleration as the pins show it.
type Info struct {
	// Installed: maps/ae_accel exists.
	Installed bool `json:"installed"`
	// Active: links/accel_sockops exists, so new hops are accelerated.
	Active bool `json:"active"`
	// Sockets in ae_accel (sending ends) and ae_accel_rx (receiving) now.
	Senders   int   `json:"senders"`
	Receivers int   `json:"receivers"`
	Stats     Stats `json:"stats"`
}

// Stats are the acceleration's counters, summed over CPUs.
type Stats struct {
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

// Read reads the acceleration's pins under bpffsDir.
func Read(bpffsDir string) (Info, error) {
	var info Info
	if _, err := os.Stat(filepath.Join(bpfobj.LinksDir(bpffsDir), SockopsPin)); err == nil {
		info.Active = true
	}
	ro := &ebpf.LoadPinOptions{ReadOnly: true}
	if _, err := os.Stat(filepath.Join(bpfobj.MapsDir(bpffsDir), accelMapAeAccel)); errors.Is(err, os.ErrNotExist) {
		return info, nil
	}
	info.Installed = true
	var err error
	if info.Senders, err = countPinned(filepath.Join(bpfobj.MapsDir(bpffsDir), accelMapAeAccel)); err != nil {
		return info, err
	}
	if info.Receivers, err = countPinned(filepath.Join(bpfobj.MapsDir(bpffsDir), accelMapAeAccelRx)); err != nil {
		return info, err
	}
	sm, err := ebpf.LoadPinnedMap(filepath.Join(bpfobj.MapsDir(bpffsDir), accelMapAeAccelStats), ro)
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
