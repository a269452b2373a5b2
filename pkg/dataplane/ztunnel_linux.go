// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// AttachZtunnel attaches the socket programs to ztunnel's cgroup with
// per-pod socket hooks (Config.SocketHooks); in the shared mode they are
// there already and it does nothing. ztunnel's sockets in enrolled pods'
// netns need them: its inbound listeners are filed by sockops, its reads
// of original destinations answered by getsockopt, its connections to its
// pods' apps filed at connect. So it must run before ztunnel is handed a
// pod: when ztunnel connects. A second ztunnel (a rollout) is attached
// beside the first; the links of a cgroup that is gone are removed here.
// Idempotent; on error nothing it attached stays.
func (d *Dataplane) AttachZtunnel(cgroup string) error {
	if d.cfg.SocketHooks != SocketHooksPods {
		return nil
	}
	if !filepath.IsAbs(cgroup) || filepath.Clean(cgroup) != cgroup || !strings.HasPrefix(cgroup, d.cfg.PodsCgroup+"/") {
		return fmt.Errorf("ztunnel's cgroup %q is not a clean path below the pods cgroup %s", cgroup, d.cfg.PodsCgroup)
	}
	id, err := hostfs.CgroupID(cgroup)
	if err != nil {
		return fmt.Errorf("ztunnel's cgroup: %w", err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	dir := filepath.Join(bpfobj.ZtunnelDir(d.cfg.BPFFSDir), strconv.FormatUint(id, 10))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create ztunnel's pin directory: %w", err)
	}
	var attached []tcProgram
	for _, a := range d.cgroupPlan(cgroup) {
		pin := filepath.Join(dir, a.pin)
		if _, err := os.Stat(pin); err == nil {
			continue // attached before, by this agent or an earlier one (moved to this build's programs in New)
		}
		l, err := cgroupHooks{}.attach(a, pin)
		if err != nil {
			for _, l := range attached {
				_ = l.detach()
			}
			_ = os.Remove(dir) // if this call made it
			return fmt.Errorf("ztunnel's cgroup %s: %w", cgroup, err)
		}
		attached = append(attached, l)
	}
	if len(attached) > 0 {
		d.log.Info("socket programs attached to ztunnel's cgroup", "cgroup", cgroup, "id", id)
	}
	d.pruneZtunnelLinks()
	return nil
}

// settleZtunnelLinks runs in New after the pods are adopted: with per-pod
// socket hooks, the links of ztunnel's cgroups run this build's programs
// from now on (an atomic replace each) and those of cgroups that are gone
// are removed; in the shared mode, where the pods' cgroup has every
// program now, they all go.
func (d *Dataplane) settleZtunnelLinks() {
	root := bpfobj.ZtunnelDir(d.cfg.BPFFSDir)
	if d.cfg.SocketHooks != SocketHooksPods {
		if _, err := os.Stat(root); err == nil {
			d.log.Info("removing the socket programs of ztunnel's cgroups: the socket hooks are shared")
			if err := d.detachZtunnelLinks(); err != nil {
				d.log.Warn("remove the links of ztunnel's cgroups", "dir", root, "error", err)
			}
		}
		return
	}
	d.pruneZtunnelLinks()
	dirs, _ := os.ReadDir(root)
	for _, e := range dirs {
		for _, a := range d.cgroupPlan("") {
			pin := filepath.Join(root, e.Name(), a.pin)
			if _, err := os.Stat(pin); err != nil {
				continue
			}
			if _, err := adoptLink(a, pin); err != nil {
				d.log.Warn("move a socket program of ztunnel's cgroup to this build's", "cgroup id", e.Name(), "pin", a.pin, "error", err)
			}
		}
	}
}

// pruneZtunnelLinks removes the links of ztunnel cgroups that are gone:
// the kernel detached them (their cgroup reads as id 0), their pins
// remain.
func (d *Dataplane) pruneZtunnelLinks() {
	root := bpfobj.ZtunnelDir(d.cfg.BPFFSDir)
	dirs, _ := os.ReadDir(root)
	for _, e := range dirs {
		dir := filepath.Join(root, e.Name())
		if live, err := cgroupLinkLive(filepath.Join(dir, bpfobj.CgroupHooks()[0].Name)); live || err != nil && !errors.Is(err, os.ErrNotExist) {
			continue
		}
		d.log.Info("removing the socket programs of a ztunnel cgroup that is gone", "cgroup id", e.Name())
		if err := detachAll(dir); err != nil {
			d.log.Warn("remove the links of a ztunnel cgroup", "dir", dir, "error", err)
		}
	}
}

// detachZtunnelLinks detaches the links of every ztunnel cgroup and
// removes their pins (Uninstall, a switch to shared hooks).
func (d *Dataplane) detachZtunnelLinks() error {
	root := bpfobj.ZtunnelDir(d.cfg.BPFFSDir)
	dirs, _ := os.ReadDir(root)
	var errs []error
	for _, e := range dirs {
		errs = append(errs, detachAll(filepath.Join(root, e.Name())))
	}
	if err := os.RemoveAll(root); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// detachAll detaches every link pinned in dir, explicitly
// (BPF_LINK_DETACH): removing a pin alone leaves its link attached while
// another process holds it open (a tool listing the node's links, say).
// Then dir goes.
func detachAll(dir string) error {
	pins, _ := os.ReadDir(dir)
	var errs []error
	for _, p := range pins {
		if err := pinnedLink(filepath.Join(dir, p.Name())).detach(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := os.RemoveAll(dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// cgroupLinkLive reports whether the cgroup link pinned at pin is still
// attached to a cgroup.
func cgroupLinkLive(pin string) (bool, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return false, err
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return false, fmt.Errorf("read link info of %s: %w", pin, err)
	}
	cg := info.Cgroup()
	return cg != nil && cg.CgroupId != 0, nil
}
