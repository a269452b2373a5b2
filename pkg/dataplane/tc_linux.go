// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// tcHooks attaches one kind of per-pod program: TC programs as classic
// tc filters, sk_lookup programs as netns links.
type tcHooks interface {
	// attach attaches a.prog to a.iface in a.netns and pins it at pin.
	// Programs other software attached keep running.
	attach(a attachment, pin string) (tcProgram, error)
	// adopt takes over what an earlier agent pinned at pin and moves it to
	// a.prog in place: traffic never sees the interface without a program.
	adopt(a attachment, pin string) (tcProgram, error)
	// count returns how many BPF programs run on the hook (any owner's).
	count(netnsPath, iface string, attach ebpf.AttachType) (int, error)
}

// pickTCHooks returns how TC programs are attached: classic tc filters on
// every kernel. A TCX attach (and detach) waits for an RCU grace period
// (synchronize_rcu in the kernel's tcx_entry_sync), about 16 ms on a
// 2-core node, three times per pod; a cls_bpf filter takes about 0.1 ms.
// Both chain with other software's programs: a TCX program of the primary
// CNI runs before ours, a classic filter of lower priority too.
func pickTCHooks() tcHooks { return classicHooks{} }

// tcProgram is one attached per-pod program. It holds no descriptor:
// its pin (and a tc filter in the kernel) keeps it attached, and what
// needs it opens the pin. A node of 8192 pods would otherwise need tens
// of thousands of descriptors (a program and its BTF per filter, a link).
type tcProgram interface {
	// detach removes the program from its interface and its pin.
	detach() error
}

// attachedTo resolves a's interface inside its netns and runs fn there.
func attachedTo(a attachment, fn func(ifindex int) error) error {
	return nsexec.OnInterface(a.netns, a.iface, fn)
}

// replacePin pins obj at pin, replacing whatever an earlier agent left.
func replacePin(pin string, obj interface{ Pin(string) error }) error {
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("replace pin %s: %w", pin, err)
	}
	if err := obj.Pin(pin); err != nil {
		return fmt.Errorf("pin %s: %w", pin, err)
	}
	return nil
}

// pinnedLink is a program attached by a bpf_link, held by its pin (the
// path): a link no pin and no descriptor holds is detached.
type pinnedLink string

// detach detaches the link pinned at pin and removes the pin; a pin that
// is gone took its link with it.
func (pin pinnedLink) detach() error {
	l, err := link.LoadPinnedLink(string(pin), nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	return detachLink(l)
}

// detachLink detaches a link loaded from its pin, removes the pin and
// closes the link.
func detachLink(l link.Link) error {
	defer l.Close()
	// Detach first (BPF_LINK_DETACH, 5.9+): the program leaves the hook
	// even while another process holds the link open.
	_ = l.Detach()
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("remove link pin: %w", err)
	}
	return nil
}

// pinnedObject is a program or link loaded from its pin.
type pinnedObject interface {
	Pin(string) error
	Unpin() error
	Close() error
}

// heldPin is a pod's pinned program or link, opened for the length of an
// enrolment that pins another in its place (the pod's new netns): it
// runs on until the enrolment is done, and goes back to its pin if the
// enrolment fails.
type heldPin struct {
	pin string
	obj pinnedObject
}

// restore pins the object again in place of whatever its pin holds now.
func (h heldPin) restore() error {
	// Forget the path it was loaded from, or Pin takes it as done.
	if err := h.obj.Unpin(); err != nil {
		return fmt.Errorf("remove pin %s: %w", h.pin, err)
	}
	return replacePin(h.pin, h.obj)
}

// heldPins are the pins of a pod that an enrolment holds.
type heldPins []heldPin

// holdPins opens the pinned programs and links of st.
func holdPins(st *podState) (heldPins, error) {
	var held heldPins
	for _, l := range st.links {
		var (
			obj pinnedObject
			pin string
			err error
		)
		switch l := l.(type) {
		case pinnedLink:
			pin = string(l)
			obj, err = link.LoadPinnedLink(pin, nil)
		case *tcFilter:
			pin = l.pin
			obj, err = ebpf.LoadPinnedProgram(pin, nil)
		}
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			held.close()
			return nil, fmt.Errorf("hold pin %s: %w", pin, err)
		}
		held = append(held, heldPin{pin: pin, obj: obj})
	}
	return held, nil
}

// restore pins everything held again (the enrolment failed).
func (held heldPins) restore() {
	for _, h := range held {
		_ = h.restore()
	}
}

// close drops the handles: a link that is pinned no more is detached
// (a tc program stays while its filter runs it).
func (held heldPins) close() {
	for _, h := range held {
		_ = h.obj.Close()
	}
}

// netnsHooks attaches sk_lookup programs to a netns with a bpf_link
// (Linux 5.9). Attaching one does not wait for the kernel.
type netnsHooks struct{}

func (netnsHooks) count(string, string, ebpf.AttachType) (int, error) {
	return 0, errors.New("sk_lookup is no tc hook")
}

func (netnsHooks) attach(a attachment, pin string) (tcProgram, error) {
	ns, err := os.Open(a.netns)
	if err != nil {
		return nil, fmt.Errorf("open netns: %w", err)
	}
	defer ns.Close()
	l, err := link.AttachNetNs(int(ns.Fd()), a.prog)
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", a, err)
	}
	return pinAttached(l, pin)
}

// pinAttached pins a link just made at pin, which holds it from then
// on; unpinned, it detaches as it closes.
func pinAttached(l link.Link, pin string) (tcProgram, error) {
	defer l.Close()
	if err := replacePin(pin, l); err != nil {
		return nil, err
	}
	return pinnedLink(pin), nil
}

func (netnsHooks) adopt(a attachment, pin string) (tcProgram, error) { return adoptLink(a, pin) }

// cgroupHooks attaches a socket program to a cgroup (the per-pod socket
// hooks, Config.SocketHooks) by a bpf_link, pinned as sk_lookup's is. A
// cgroup that goes away takes its programs with it; the pin stays until
// the pod's removal.
type cgroupHooks struct{}

func (cgroupHooks) count(string, string, ebpf.AttachType) (int, error) {
	return 0, errors.New("a cgroup is no tc hook")
}

func (cgroupHooks) attach(a attachment, pin string) (tcProgram, error) {
	if a.cgroup == "" {
		return nil, fmt.Errorf("attach %s: no cgroup known", a)
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: a.cgroup, Attach: a.attach, Program: a.prog})
	if err != nil {
		return nil, fmt.Errorf("attach %s: %w", a, err)
	}
	return pinAttached(l, pin)
}

func (cgroupHooks) adopt(a attachment, pin string) (tcProgram, error) { return adoptLink(a, pin) }

// adoptLink moves the link pinned at pin to a's program in place.
func adoptLink(a attachment, pin string) (tcProgram, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return nil, fmt.Errorf("load pinned link %s: %w", pin, err)
	}
	defer l.Close() // the pin holds it
	if err := l.Update(a.prog); err != nil {
		return nil, fmt.Errorf("update %s: %w", a, err)
	}
	return pinnedLink(pin), nil
}

// classicHooks uses classic tc: a cls_bpf filter in direct-action mode on
// the clsact qdisc, which is created when missing and never deleted
// (others may use it). The programs return TCX_NEXT (-1),
// which is TC_ACT_UNSPEC: the next filter runs, as with TCX. A filter is
// no bpf_link, so the program itself is pinned; the filter lives on in the
// kernel while no agent runs.
type classicHooks struct{}

// tcFilter is our filter on a's interface, with its program pinned at
// pin.
type tcFilter struct {
	a   attachment
	pin string
}

func (a attachment) filter(ifindex int, prog *ebpf.Program) *netlink.BpfFilter {
	return &netlink.BpfFilter{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: ifindex,
			Parent:    bpfobj.TCParent(a.attach),
			Handle:    bpfobj.TCFilterHandle,
			Priority:  bpfobj.TCFilterPriority,
			Protocol:  unix.ETH_P_ALL,
		},
		Fd:           prog.FD(),
		Name:         a.filterName(),
		DirectAction: true,
		ClassId:      a.classid,
	}
}

// filterName names the filter after its pin (bpfobj.TCFilterName); the
// kernel keeps at most 255 bytes.
func (a attachment) filterName() string { return bpfobj.TCFilterName(a.pin) }

// setFilter creates or atomically replaces our filter on a's interface.
func (a attachment) setFilter(prog *ebpf.Program) error {
	return attachedTo(a, func(ifindex int) error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		qdisc := &netlink.GenericQdisc{
			QdiscAttrs: netlink.QdiscAttrs{LinkIndex: ifindex, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT},
			QdiscType:  "clsact",
		}
		if err := h.QdiscAdd(qdisc); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("add clsact qdisc to %s: %w", a.iface, err)
		}
		// A new filter is one request; only when one sits at our
		// priority and handle already (an adoption, a re-enrolment) is
		// it checked to be ours and replaced in place.
		err = h.FilterAdd(a.filter(ifindex, prog))
		if !errors.Is(err, unix.EEXIST) {
			if err != nil {
				return fmt.Errorf("attach %s: %w", a, err)
			}
			return nil
		}
		filters, err := listFilters(ifindex, bpfobj.TCParent(a.attach))
		if err != nil {
			return err
		}
		for _, bf := range filters {
			if bf.Priority == bpfobj.TCFilterPriority && bf.Handle == bpfobj.TCFilterHandle && !a.ours(bf) {
				return fmt.Errorf("attach %s: tc filter priority %#x handle %#x is taken by %q", a, bpfobj.TCFilterPriority, bpfobj.TCFilterHandle, bf.Name)
			}
		}
		if err := h.FilterReplace(a.filter(ifindex, prog)); err != nil {
			return fmt.Errorf("attach %s: %w", a, err)
		}
		return nil
	})
}

func (classicHooks) attach(a attachment, pin string) (tcProgram, error) {
	if err := a.setFilter(a.prog); err != nil {
		return nil, err
	}
	f := &tcFilter{a: a, pin: pin}
	if err := pinProgram(pin, a.prog); err != nil {
		_ = f.detach()
		return nil, err
	}
	return f, nil
}

// adopt replaces the filter in place (same priority and handle: the kernel
// swaps the program atomically) and re-pins the new program.
func (classicHooks) adopt(a attachment, pin string) (tcProgram, error) {
	if _, err := os.Stat(pin); err != nil {
		return nil, fmt.Errorf("pinned program %s: %w", pin, err)
	}
	if a.netns == "" {
		return nil, fmt.Errorf("adopt %s: the pod's netns is not known", a)
	}
	if err := a.setFilter(a.prog); err != nil {
		return nil, err
	}
	if err := pinProgram(pin, a.prog); err != nil {
		return nil, err
	}
	return &tcFilter{a: a, pin: pin}, nil
}

// pinProgram pins the shared program prog (one for all pods: the filter's
// classid names the pod) at pin, in place of what an earlier agent left.
// The pin is made through a short-lived clone: the shared program's own
// Pin would move its earlier pin instead of adding one.
func pinProgram(pin string, prog *ebpf.Program) error {
	c, err := prog.Clone()
	if err != nil {
		return fmt.Errorf("pin %s: clone program: %w", pin, err)
	}
	defer c.Close()
	return replacePin(pin, c)
}

func (classicHooks) count(netnsPath, iface string, attach ebpf.AttachType) (int, error) {
	var n int
	err := attachedTo(attachment{netns: netnsPath, iface: iface}, func(ifindex int) error {
		filters, err := listFilters(ifindex, bpfobj.TCParent(attach))
		n = len(filters)
		return err
	})
	return n, err
}

// listFilters lists the bpf filters on a clsact hook; none when the
// interface has no clsact qdisc.
func listFilters(ifindex int, parent uint32) ([]*netlink.BpfFilter, error) {
	l, err := netlink.LinkByIndex(ifindex)
	if err != nil {
		return nil, fmt.Errorf("find interface %d: %w", ifindex, err)
	}
	all, err := netlink.FilterList(l, parent)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return nil, fmt.Errorf("list tc filters on %s: %w", l.Attrs().Name, err)
	}
	var out []*netlink.BpfFilter
	for _, f := range all {
		if bf, ok := f.(*netlink.BpfFilter); ok {
			out = append(out, bf)
		}
	}
	return out, nil
}

// ours reports whether bf is the filter a attached.
func (a attachment) ours(bf *netlink.BpfFilter) bool {
	return bpfobj.OurFilter(a.pin, bf)
}

// detach deletes our filter (matched by priority, handle and name; the
// qdisc and other filters stay), then the pin. An interface that is gone
// took the filter with it.
func (f *tcFilter) detach() error {
	var errs []error
	if f.a.netns != "" {
		err := attachedTo(f.a, func(ifindex int) error {
			filters, err := listFilters(ifindex, bpfobj.TCParent(f.a.attach))
			if err != nil {
				return err
			}
			for _, bf := range filters {
				if f.a.ours(bf) {
					if err := netlink.FilterDel(bf); err != nil && !errors.Is(err, unix.ENOENT) {
						return fmt.Errorf("delete tc filter %s: %w", f.a, err)
					}
				}
			}
			return nil
		})
		if err != nil && !errors.Is(err, os.ErrNotExist) && !isNoSuchInterface(err) {
			errs = append(errs, err)
		}
	}
	if err := os.Remove(f.pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("remove pin %s: %w", f.pin, err))
	}
	return errors.Join(errs...)
}

// isNoSuchInterface reports the errors of an interface that is gone:
// the kernel's ENODEV (or a *net.OpError of the net package's lookups).
func isNoSuchInterface(err error) bool {
	var nerr *net.OpError
	return errors.As(err, &nerr) && nerr.Op == "route" || errors.Is(err, unix.ENODEV)
}
