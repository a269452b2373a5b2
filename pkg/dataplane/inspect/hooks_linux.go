// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// Read-only views of the hooks the data path shares with other software,
// for `ambient-ebpf doctor`: what else runs on the cgroup socket hooks and
// on each pod's tc hooks, and in which order.

// SocketHooks names the node-wide cgroup hooks (links/<name>), in order.
func SocketHooks() []string {
	var names []string
	for _, h := range bpfobj.NodeHooks() {
		names = append(names, h.Name)
	}
	return names
}

// CgroupProgram is a BPF program on one of the data path's cgroup hooks.
type CgroupProgram struct {
	Hook   string `json:"hook"`   // connect4, sendmsg6, sockops, ... (links/<hook>)
	Cgroup string `json:"cgroup"` // the directory it is attached to
	ID     uint32 `json:"id"`
	Name   string `json:"name"`
	// Ours: the program of a link pinned under the bpffs directory.
	Ours bool `json:"ours"`
}

// CgroupPrograms lists the programs attached to the data path's socket
// hooks anywhere in the cgroup tree at root, root first. Programs on a
// descendant run before the root's for the sockets below it. At most
// maxCgroups directories are visited; truncated says the tree had more.
// bpffsDir names the pins whose programs are ours (none before install).
func CgroupPrograms(root, bpffsDir string, maxCgroups int) (progs []CgroupProgram, truncated bool, err error) {
	ours := map[ebpf.ProgramID]bool{}
	hooks := bpfobj.NodeHooks()
	pins := []string{accel.SockopsPin} // the sockmap acceleration's sockops, beside ours
	for _, h := range slices.Concat(hooks, bpfobj.NodeScopeHooks()) {
		pins = append(pins, h.Name)
	}
	paths := make([]string, 0, len(pins)+2*len(hooks))
	for _, name := range pins {
		paths = append(paths, filepath.Join(bpffsDir, "links", name))
	}
	// Per-pod socket hooks: every pod's and ztunnel's links run the same
	// programs, so one directory of each names them.
	for _, dir := range []string{bpfobj.PodsDir(bpffsDir), bpfobj.ZtunnelDir(bpffsDir)} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if _, err := os.Stat(filepath.Join(dir, e.Name(), bpfobj.CgroupHooks()[0].Name)); err != nil {
				continue
			}
			for _, h := range bpfobj.CgroupHooks() {
				paths = append(paths, filepath.Join(dir, e.Name(), h.Name))
			}
			break
		}
	}
	for _, path := range paths {
		l, err := link.LoadPinnedLink(path, nil)
		if err != nil {
			continue
		}
		if info, err := l.Info(); err == nil {
			ours[info.Program] = true
		}
		l.Close()
	}
	visited := 0
	walkErr := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == root {
				return err
			}
			return nil // a cgroup removed while walking
		}
		if !d.IsDir() {
			return nil
		}
		if visited == maxCgroups {
			truncated = true
			return filepath.SkipAll
		}
		visited++
		found, err := cgroupHookPrograms(path, hooks)
		if err != nil && path == root {
			return err
		}
		for i := range found {
			found[i].Ours = ours[ebpf.ProgramID(found[i].ID)]
		}
		progs = append(progs, found...)
		return nil
	})
	if walkErr != nil {
		return nil, false, fmt.Errorf("cgroup %s: %w", root, walkErr)
	}
	return progs, truncated, nil
}

func cgroupHookPrograms(dir string, hooks []bpfobj.NodeHook) ([]CgroupProgram, error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []CgroupProgram
	for _, h := range hooks {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: h.Attach})
		if err != nil {
			return out, fmt.Errorf("query %s programs: %w", h.Name, err)
		}
		for _, ap := range res.Programs {
			out = append(out, CgroupProgram{Hook: h.Name, Cgroup: dir, ID: uint32(ap.ID), Name: programName(ap.ID)})
		}
	}
	return out, nil
}

func programName(id ebpf.ProgramID) string {
	p, err := ebpf.NewProgramFromID(id)
	if err != nil {
		return ""
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return ""
	}
	return info.Name
}

// TCHook is one of an enrolled pod's per-pod hooks as the kernel has it.
type TCHook struct {
	Pod       string `json:"pod"` // namespace/name
	Pin       string `json:"pin"` // pods/<uid>/<pin>
	Netns     string `json:"netns"`
	Interface string `json:"interface,omitempty"` // empty for sk_lookup
	// Direction is ingress or egress; sk_lookup for the netns hook.
	Direction string `json:"direction"`
	// Attached: our program is on the hook.
	Attached bool `json:"attached"`
	// Ahead are the other programs and filters that run first; any of
	// them can end the chain before ours runs.
	Ahead []HookEntry `json:"ahead,omitempty"`
	// Error says why the hook could not be read (netns or interface gone).
	Error string `json:"error,omitempty"`
}

// HookEntry is another program or filter on a hook.
type HookEntry struct {
	// Kind is tcx (a TCX link or program), sk_lookup, or the classic
	// filter's kind (bpf, u32, matchall, ...).
	Kind string `json:"kind"`
	Name string `json:"name,omitempty"`
	ID   uint32 `json:"id,omitempty"` // program id, for BPF programs
	// Priority and DirectAction of a classic filter.
	Priority     uint16 `json:"priority,omitempty"`
	DirectAction bool   `json:"directAction,omitempty"`
}

// TCHooks reads every enrolled pod's tc and sk_lookup hooks: whether our
// program is there and what runs before it. nodeNetns is the netns of the
// pods' host-side veths (dataplane.Config.NodeNetns). A pod whose netns path no
// longer names its netns reports that in its hooks' Error.
func (p *Pinned) TCHooks(nodeNetns string) ([]TCHook, error) {
	pods, err := ReadPods(&p.maps)
	if err != nil {
		return nil, err
	}
	if nodeNetns == "" {
		nodeNetns = "/proc/self/ns/net"
	}
	direct := p.ProbeMode() == bpfobj.ProbeDirect
	var out []TCHook
	for _, st := range pods {
		if st.Journal != bpfobj.MetaEnrolled {
			continue
		}
		hostIf := st.HostInterface
		if direct {
			hostIf = "" // nothing on the node side in the direct host-probe mode
		}
		dir := bpfobj.PodDir(p.dir, st.UID)
		AddPinnedReroutes(dir, &st.Options)
		_, err := os.Stat(filepath.Join(dir, "ingress"))
		netnsErr := CheckNetns(st.NetnsPath, st.NetnsCookie)
		for _, a := range bpfobj.PodHooks(st.NetnsPath, st.Interface, st.Options.RerouteInterfaces, hostIf, nodeNetns, st.Slot, err == nil) {
			h := TCHook{Pod: st.Namespace + "/" + st.Name, Pin: a.Pin, Netns: a.Netns, Interface: a.Iface, Direction: direction(a.Attach)}
			switch {
			case a.Netns != nodeNetns && netnsErr != nil:
				h.Error = netnsErr.Error()
			case a.Attach == ebpf.AttachSkLookup:
				err = readSkLookupHook(&h, filepath.Join(dir, a.Pin))
			default:
				err = readTCHook(&h, a)
			}
			if err != nil {
				h.Error = err.Error()
			}
			out = append(out, h)
		}
	}
	return out, nil
}

func direction(attach ebpf.AttachType) string {
	switch attach {
	case ebpf.AttachSkLookup:
		return "sk_lookup"
	case ebpf.AttachTCXEgress:
		return "egress"
	}
	return "ingress"
}

// CheckNetns checks that path still is the netns with the cookie (a
// /proc/<pid>/ns/net path may name another process's by now).
func CheckNetns(path string, cookie uint64) error {
	if path == "" {
		return errors.New("the pod's netns is not known")
	}
	var got uint64
	if err := nsexec.Do(path, func() (err error) { got, err = nsexec.Cookie(); return err }); err != nil {
		return err
	}
	if got != cookie {
		return fmt.Errorf("%s is no longer the pod's netns (cookie %d, want %d)", path, got, cookie)
	}
	return nil
}

// readSkLookupHook lists the netns' sk_lookup programs in the order they
// run; those before the pinned link's program are ahead of ours.
func readSkLookupHook(h *TCHook, pin string) error {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	info, err := l.Info()
	l.Close()
	if err != nil {
		return fmt.Errorf("read link %s: %w", pin, err)
	}
	ns, err := os.Open(h.Netns)
	if err != nil {
		return fmt.Errorf("open netns: %w", err)
	}
	defer ns.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(ns.Fd()), Attach: ebpf.AttachSkLookup})
	if err != nil {
		return err
	}
	for _, ap := range res.Programs {
		if ap.ID == info.Program {
			h.Attached = true
			break
		}
		h.Ahead = append(h.Ahead, HookEntry{Kind: "sk_lookup", ID: uint32(ap.ID), Name: programName(ap.ID)})
	}
	return nil
}

// readTCHook lists what runs on a's interface and direction before our
// filter: every TCX program (TCX runs before classic tc), then classic
// filters of a lower priority, or of ours under another handle.
func readTCHook(h *TCHook, a bpfobj.PodHook) error {
	return nsexec.OnInterface(a.Netns, a.Iface, func(ifindex int) error {
		res, err := link.QueryPrograms(link.QueryOptions{Target: ifindex, Attach: a.Attach})
		if err == nil {
			for _, ap := range res.Programs {
				h.Ahead = append(h.Ahead, HookEntry{Kind: "tcx", ID: uint32(ap.ID), Name: programName(ap.ID)})
			}
		} else if !errors.Is(err, ebpf.ErrNotSupported) && !errors.Is(err, unix.EINVAL) {
			return err
		}
		l, err := netlink.LinkByIndex(ifindex)
		if err != nil {
			return fmt.Errorf("find interface %d: %w", ifindex, err)
		}
		filters, err := netlink.FilterList(l, bpfobj.TCParent(a.Attach))
		if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("list tc filters on %s: %w", a.Iface, err)
		}
		slices.SortStableFunc(filters, func(x, y netlink.Filter) int { return int(x.Attrs().Priority) - int(y.Attrs().Priority) })
		for _, f := range filters {
			fa := f.Attrs()
			if bf, ok := f.(*netlink.BpfFilter); ok && bpfobj.OurFilter(a.Pin, bf) {
				h.Attached = true
				continue
			}
			if fa.Priority > bpfobj.TCFilterPriority || fa.Priority == bpfobj.TCFilterPriority && fa.Handle == bpfobj.TCFilterHandle {
				continue
			}
			e := HookEntry{Kind: f.Type(), Priority: fa.Priority}
			if bf, ok := f.(*netlink.BpfFilter); ok {
				e.Name, e.ID, e.DirectAction = bf.Name, uint32(bf.Id), bf.DirectAction
			}
			h.Ahead = append(h.Ahead, e)
		}
		return nil
	})
}
