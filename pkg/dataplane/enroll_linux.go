// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// Enroll puts a pod's traffic through ztunnel. It is idempotent: enrolling
// an enrolled pod again brings its entries up to date (new IPs, options or
// netns). When any step fails, what this call changed is undone.
func (d *Dataplane) Enroll(ctx context.Context, pod Pod) error {
	pod.IPs = slices.Clone(pod.IPs)
	pod.normalize()
	if err := pod.validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()

	old := d.pods[pod.UID]
	var undo []func()
	rollback := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}

	// The ingress link is attached before any map entry exists, so the
	// pod is never half redirected: outbound capture starts with the
	// ae_netns entry, which is written last. A pod enrolled again in the
	// same netns keeps its link.
	keep := func(cookie uint64) bool { return old != nil && old.NetnsCookie == cookie && old.ingress != nil }
	ingress, cookie, err := d.attachIngress(&pod, keep)
	if err != nil {
		return err
	}
	reused := ingress == nil
	if reused {
		ingress = old.ingress
	} else {
		undo = append(undo, func() { ingress.Close() })
	}

	st := &podState{netnsPath: pod.Netns, ingress: ingress}
	if old != nil && old.NetnsCookie == cookie {
		st.Slot = old.Slot
	} else {
		slot, ok := d.slots.alloc()
		if !ok {
			rollback()
			return fmt.Errorf("pod %s/%s: %d pods enrolled already, the maximum", pod.Namespace, pod.Name, maxPods)
		}
		st.Slot = slot
		undo = append(undo, func() { d.slots.release(slot) })
		// A new slot starts counting from zero.
		if err := d.sock.AeStats.Put(slot, make([]sockPodStats, ebpf.MustPossibleCPU())); err != nil {
			rollback()
			return fmt.Errorf("pod %s/%s: reset ae_stats: %w", pod.Namespace, pod.Name, err)
		}
	}
	st.EnrolledPod = EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Interface: pod.Interface,
		NetnsCookie: cookie, IPs: pod.IPs, Options: pod.Options, Slot: st.Slot,
	}

	if !reused {
		if err := d.pinIngress(pod.UID, ingress); err != nil {
			rollback()
			return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
	}
	if err := d.writePodMaps(&pod, st); err != nil {
		rollback()
		if old != nil {
			// Put the previous state back where it was.
			if !reused && old.ingress != nil {
				_ = d.pinIngress(pod.UID, old.ingress)
			}
			_ = d.writePodMaps(nil, old)
		} else {
			_ = os.RemoveAll(podDir(d.cfg, pod.UID))
			d.deletePodEntries(st)
		}
		return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}

	if old != nil {
		// The old link was replaced by the new one (same pin path). Its
		// entries that the new state does not cover are removed.
		if old.ingress != nil && !reused {
			old.ingress.Close()
		}
		d.deleteStaleEntries(old, st)
		if old.Slot != st.Slot {
			d.slots.release(old.Slot)
		}
	}
	d.pods[pod.UID] = st
	d.log.Debug("pod enrolled", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "ips", pod.IPs, "slot", st.Slot)
	return nil
}

// pinIngress pins l as the pod's ingress link, replacing an older pin.
func (d *Dataplane) pinIngress(uid string, l link.Link) error {
	dir := podDir(d.cfg, uid)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create pod pin directory: %w", err)
	}
	pin := filepath.Join(dir, "ingress")
	if err := os.Remove(pin); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("replace ingress pin: %w", err)
	}
	if err := l.Pin(pin); err != nil {
		return fmt.Errorf("pin ingress link: %w", err)
	}
	return nil
}

// writePodMaps writes the metadata, the per-IP entries and, last, the
// netns entry that switches outbound capture on. pod is nil when st is
// written back during a rollback.
func (d *Dataplane) writePodMaps(pod *Pod, st *podState) error {
	p := pod
	if p == nil {
		p = &Pod{UID: st.UID, Namespace: st.Namespace, Name: st.Name, Interface: st.Interface, IPs: st.IPs, Options: st.Options}
	}
	var meta sockPodMeta
	cString(meta.Uid[:], p.UID)
	cString(meta.Namespace[:], p.Namespace)
	cString(meta.Name[:], p.Name)
	cString(meta.Ifname[:], p.Interface)
	meta.NetnsCookie = st.NetnsCookie
	meta.InUse = 1
	if err := d.sock.AePodMeta.Put(st.Slot, &meta); err != nil {
		return fmt.Errorf("write ae_pod_meta: %w", err)
	}
	info := sockPodInfo{NetnsCookie: st.NetnsCookie, Slot: st.Slot, Flags: p.flags()}
	for _, ip := range p.IPs {
		// A reused IP simply gets its new owner (H4): the old owner's
		// removal checks ownership before deleting.
		if err := d.sock.AePods.Put(addrKey(ip), &info); err != nil {
			return fmt.Errorf("write ae_pods entry for %s: %w", ip, err)
		}
	}
	ns := p.netnsInfo(st.Slot)
	if err := d.sock.AeNetns.Put(st.NetnsCookie, &ns); err != nil {
		return fmt.Errorf("write ae_netns: %w", err)
	}
	return nil
}

// deleteStaleEntries removes the entries of old that cur no longer owns.
func (d *Dataplane) deleteStaleEntries(old, cur *podState) {
	for _, ip := range old.IPs {
		if !slices.Contains(cur.IPs, ip) {
			d.deleteOwnedIP(ip, old)
		}
	}
	if old.NetnsCookie != cur.NetnsCookie {
		d.deleteOwnedNetns(old)
	}
	if old.Slot != cur.Slot {
		d.clearSlot(old.Slot)
	}
}

// deletePodEntries removes every map entry st owns.
func (d *Dataplane) deletePodEntries(st *podState) {
	d.deleteOwnedNetns(st)
	for _, ip := range st.IPs {
		d.deleteOwnedIP(ip, st)
	}
	d.clearSlot(st.Slot)
}

func (d *Dataplane) deleteOwnedIP(ip netip.Addr, st *podState) {
	var info sockPodInfo
	if err := d.sock.AePods.Lookup(addrKey(ip), &info); err != nil {
		return
	}
	if info.NetnsCookie == st.NetnsCookie && info.Slot == st.Slot {
		_ = d.sock.AePods.Delete(addrKey(ip))
	}
}

func (d *Dataplane) deleteOwnedNetns(st *podState) {
	var ns sockNetnsInfo
	if err := d.sock.AeNetns.Lookup(st.NetnsCookie, &ns); err == nil && ns.Slot == st.Slot {
		_ = d.sock.AeNetns.Delete(st.NetnsCookie)
	}
}

func (d *Dataplane) clearSlot(slot uint32) {
	_ = d.sock.AePodMeta.Put(slot, &sockPodMeta{})
}

// Remove takes a pod out of the data path: its traffic flows directly
// again (R16). Removing a pod that is not enrolled is not an error. Entries
// of a reused IP that now belong to another pod are left alone (H4).
func (d *Dataplane) Remove(ctx context.Context, uid string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ok := d.pods[uid]
	if !ok {
		return nil
	}
	err := d.detachPod(st)
	delete(d.pods, uid)
	d.slots.release(st.Slot)
	return err
}

// detachPod deletes the pod's entries (outbound capture first), then its
// ingress link and pins.
func (d *Dataplane) detachPod(st *podState) error {
	d.deletePodEntries(st)
	var errs []error
	if st.ingress != nil {
		if err := st.ingress.Unpin(); err != nil {
			errs = append(errs, fmt.Errorf("unpin ingress link of pod %s/%s: %w", st.Namespace, st.Name, err))
		}
		st.ingress.Close()
		st.ingress = nil
	}
	if err := os.RemoveAll(podDir(d.cfg, st.UID)); err != nil {
		errs = append(errs, fmt.Errorf("remove pins of pod %s/%s: %w", st.Namespace, st.Name, err))
	}
	return errors.Join(errs...)
}

// List returns the enrolled pods, sorted by namespace and name.
func (d *Dataplane) List() []EnrolledPod {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]EnrolledPod, 0, len(d.pods))
	for _, p := range d.pods {
		e := p.EnrolledPod
		e.IPs = slices.Clone(e.IPs)
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b EnrolledPod) int {
		if c := cmpString(a.Namespace, b.Namespace); c != 0 {
			return c
		}
		return cmpString(a.Name, b.Name)
	})
	return out
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Stats returns a pod's counters.
func (d *Dataplane) Stats(uid string) (Stats, error) {
	d.mu.Lock()
	st, ok := d.pods[uid]
	d.mu.Unlock()
	if !ok {
		return Stats{}, fmt.Errorf("pod %s is not enrolled", uid)
	}
	perCPU := make([]sockPodStats, ebpf.MustPossibleCPU())
	if err := d.sock.AeStats.Lookup(st.Slot, &perCPU); err != nil {
		return Stats{}, fmt.Errorf("read ae_stats: %w", err)
	}
	var s Stats
	for _, c := range perCPU {
		s.OutboundRedirects += c.OutboundRedirects
		s.InboundRedirects += c.InboundRedirects
		s.InboundNoListener += c.InboundNoListener
		s.OrigDstErrors += c.OrigDstErrors
	}
	return s, nil
}

// adoptPods rebuilds the pod table from the pinned maps after a restart
// and moves each pod's pinned ingress link to the freshly loaded program.
func (d *Dataplane) adoptPods() error {
	bySlot := map[uint32]*podState{}
	var (
		slot uint32
		meta sockPodMeta
	)
	it := d.sock.AePodMeta.Iterate()
	for it.Next(&slot, &meta) {
		if meta.InUse == 0 {
			continue
		}
		st := &podState{EnrolledPod: EnrolledPod{
			UID: goString(meta.Uid[:]), Namespace: goString(meta.Namespace[:]), Name: goString(meta.Name[:]),
			Interface: goString(meta.Ifname[:]), NetnsCookie: meta.NetnsCookie, Slot: slot,
		}}
		bySlot[slot] = st
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("read ae_pod_meta: %w", err)
	}

	var (
		key  sockAeAddr
		info sockPodInfo
	)
	pit := d.sock.AePods.Iterate()
	for pit.Next(&key, &info) {
		if st := bySlot[info.Slot]; st != nil && st.NetnsCookie == info.NetnsCookie {
			st.IPs = append(st.IPs, netip.AddrFrom16(key.B).Unmap())
			st.Options = optionsFromFlags(info.Flags)
		}
	}
	if err := pit.Err(); err != nil {
		return fmt.Errorf("read ae_pods: %w", err)
	}

	for _, st := range bySlot {
		slices.SortFunc(st.IPs, func(a, b netip.Addr) int { return a.Compare(b) })
		d.slots.take(st.Slot)
		pin := filepath.Join(podDir(d.cfg, st.UID), "ingress")
		l, err := link.LoadPinnedLink(pin, nil)
		if err == nil {
			err = l.Update(d.tc.AePodIngress)
			if err != nil {
				l.Close()
			}
		}
		if err != nil {
			// The pod's interface may be gone with its netns; the agent's
			// reconcile removes such pods.
			d.log.Warn("adopted pod has no usable ingress link", "pod", st.Namespace+"/"+st.Name, "uid", st.UID, "error", err)
		} else {
			st.ingress = l
		}
		d.pods[st.UID] = st
	}
	if len(bySlot) > 0 {
		d.log.Info("adopted enrolled pods", "count", len(bySlot))
	}
	return nil
}

const maxPods = 8192 // AE_MAX_PODS in bpf/common.h

// slotAllocator hands out indexes into ae_pod_meta and ae_stats.
type slotAllocator struct {
	used [maxPods]bool
	next uint32
}

func (s *slotAllocator) alloc() (uint32, bool) {
	for i := uint32(0); i < maxPods; i++ {
		slot := (s.next + i) % maxPods
		if !s.used[slot] {
			s.used[slot] = true
			s.next = slot + 1
			return slot, true
		}
	}
	return 0, false
}

func (s *slotAllocator) take(slot uint32) {
	if slot < maxPods {
		s.used[slot] = true
	}
}

func (s *slotAllocator) release(slot uint32) {
	if slot < maxPods {
		s.used[slot] = false
	}
}
