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
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// Enroll puts a pod's traffic through ztunnel. It is idempotent: enrolling
// an enrolled pod again brings its entries up to date (new IPs, options or
// netns). When any step fails, what this call changed is undone; when the
// agent dies part way, the journal in ae_pod_meta lets the next one undo
// it (see adoptPods).
//
// Nothing here waits for the kernel: every per-pod program is a classic
// tc filter or an sk_lookup link, neither of which waits for an RCU grace
// period the way a TCX attach does (about 16 ms each on a 2-core node).
// Running out of descriptors is an error that names the limit.
func (d *Dataplane) Enroll(ctx context.Context, pod Pod) (err error) {
	defer func() { err = fdlimit.Annotate(err) }()
	pod.IPs = slices.Clone(pod.IPs)
	pod.Options.RerouteInterfaces = slices.Clone(pod.Options.RerouteInterfaces)
	pod.normalize()
	if err := pod.validate(); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := d.podCgroup(&pod); err != nil {
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
	fail := func(err error) error {
		rollback()
		return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}

	ns, err := d.probePodNetns(&pod)
	if err != nil {
		return err
	}
	stale, err := d.claimIPs(&pod, ns.cookie)
	if err != nil {
		return err
	}
	for _, o := range stale {
		d.removeStale(o, &pod)
	}
	samePod := old != nil && old.NetnsCookie == ns.cookie
	hostIf, err := d.hostInterface(&pod, ns.podIndex, ns.peerIndex)
	if err != nil {
		return err
	}

	st := &podState{netnsPath: pod.Netns, savedFwmark: ns.fwmarkAccept, ifindex: uint32(ns.podIndex), links: map[string]tcProgram{}}
	if samePod {
		st.Slot = old.Slot
		st.savedFwmark = old.savedFwmark // our own 1 must not become "the pod's value"
	} else {
		slot, ok := d.slots.alloc()
		if !ok {
			return fmt.Errorf("pod %s/%s: %d pods enrolled already, the maximum", pod.Namespace, pod.Name, bpfobj.MaxPods)
		}
		st.Slot = slot
		undo = append(undo, func() { d.slots.release(slot) })
	}
	st.EnrolledPod = inspect.EnrolledPod{
		UID: pod.UID, Namespace: pod.Namespace, Name: pod.Name, Interface: pod.Interface, HostInterface: hostIf,
		NetnsCookie: ns.cookie, IPs: pod.IPs, Options: pod.Options, Slot: st.Slot,
	}
	if !samePod {
		// Intent before action: the slot names the pod, its netns and
		// the sysctl value to restore before anything is changed.
		if err := d.writeMeta(st, bpfobj.MetaEnrolling); err != nil {
			return fail(err)
		}
		undo = append(undo, func() { d.clearSlot(st.Slot) })
		d.cfg.failpoint(StepEnrollJournaled)
		// A new slot starts counting from zero.
		if err := d.sock.AeStats.Put(st.Slot, make([]bpfobj.SockPodStats, ebpf.MustPossibleCPU())); err != nil {
			return fail(fmt.Errorf("reset ae_stats: %w", err))
		}
		undo = append(undo, func() { _ = teardownPodNetns(d.cfg.ProcRoot, pod.Netns, st.savedFwmark, d.sharedReturnPath(pod.Netns)) })
		// The pin directory the attachments create goes with them (it
		// is empty by then: each undone attachment removes its pin).
		undo = append(undo, func() { _ = os.Remove(podDir(d.cfg, pod.UID)) })
		if old != nil {
			// The new netns's programs take the old one's pins, which
			// are held meanwhile: the old link runs on until the new
			// state is in, and all go back to their pins if it fails.
			held, err := holdPins(old)
			if err != nil {
				return fail(err)
			}
			defer held.close()
			undo = append(undo, held.restore)
		}
	}
	if err := d.setupReturnPath(&pod); err != nil {
		return fail(err)
	}
	d.cfg.failpoint(StepEnrollReturnPath)

	// Programs first, map entries last: the pod is never half redirected,
	// because outbound capture starts with the ae_netns entry.
	for _, a := range d.plan(&pod, hostIf, st.Slot) {
		if samePod && old.links[a.pin] != nil && (a.pin != "host_egress" && a.pin != "host_ingress" || old.HostInterface == hostIf) {
			st.links[a.pin] = old.links[a.pin]
			continue
		}
		l, err := d.attach(pod.UID, a)
		if err != nil {
			return fail(err)
		}
		undo = append(undo, func() { _ = l.detach() })
		st.links[a.pin] = l
		d.cfg.failpoint(StepEnrollAttached)
	}

	// A running pod's listeners that ztunnel opened before our hooks
	// were there (a takeover from istio-cni) are filed before the pod's
	// entries, with which its sk_lookup program starts capturing: a SYN
	// in between found no listener and was refused. Sockops files only
	// an enrolled netns's listeners, so one opened from here until the
	// ae_netns entry is written is filed after it (below).
	if pod.Running {
		if err := d.fileExistingListeners(pod.Netns, ns.cookie); err != nil {
			return fail(err)
		}
	}

	err = d.writePodMaps(st)
	if err != nil {
		rollback()
		if old != nil {
			_ = d.writePodMaps(old) // put the previous state back
		} else {
			d.deletePodEntries(st)
		}
		return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}

	if old != nil {
		// Links of the old state that the new one does not use go; so do
		// its entries the new state does not cover.
		for pin, l := range old.links {
			if st.links[pin] == nil {
				_ = l.detach() // what is no longer planned
			}
		}
		d.deleteStaleEntries(old, st)
		if old.Slot != st.Slot {
			d.slots.release(old.Slot)
		}
		if !samePod {
			_ = teardownPodNetns(d.cfg.ProcRoot, old.netnsPath, old.savedFwmark, false)
		}
	}
	// The ae_netns entry is in: sockops files every listener ztunnel
	// opens from now on. One it opened before that and was not filed
	// above (the pod is not running yet, or it listened in between) is
	// filed now; four map lookups when one is filed already. A failure
	// leaves the pod enrolled: the agent's resync files it later.
	if err := d.fileExistingListeners(pod.Netns, ns.cookie); err != nil {
		d.log.Warn("file ztunnel's existing listeners; the resync tries again", "pod", pod.Namespace+"/"+pod.Name, "error", err)
	}
	st.journal = bpfobj.MetaEnrolled
	d.pods[pod.UID] = st
	d.cfg.failpoint(StepEnrollDone)
	d.log.Debug("pod enrolled", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "ips", pod.IPs, "slot", st.Slot)
	return nil
}

// podCgroup settles where the pod's socket programs go in the per-pod
// mode: its cgroup below the pods' cgroup, given or found by UID.
func (d *Dataplane) podCgroup(pod *Pod) error {
	if d.cfg.SocketHooks != SocketHooksPods {
		return nil
	}
	if pod.Cgroup == "" {
		cg, err := hostfs.PodCgroup(d.cfg.PodsCgroup, pod.UID)
		if err != nil {
			return fmt.Errorf("pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
		pod.Cgroup = cg
	}
	if !strings.HasPrefix(pod.Cgroup, d.cfg.PodsCgroup+"/") {
		return fmt.Errorf("pod %s/%s: cgroup %s is not below the pods cgroup %s", pod.Namespace, pod.Name, pod.Cgroup, d.cfg.PodsCgroup)
	}
	return nil
}

// writeMeta records the pod in its ae_pod_meta slot with a journal state.
func (d *Dataplane) writeMeta(st *podState, state uint32) error {
	var meta bpfobj.SockPodMeta
	bpfobj.CString(meta.Uid[:], st.UID)
	bpfobj.CString(meta.Namespace[:], st.Namespace)
	bpfobj.CString(meta.Name[:], st.Name)
	bpfobj.CString(meta.Ifname[:], st.Interface)
	bpfobj.CString(meta.HostIfname[:], st.HostInterface)
	bpfobj.CString(meta.Netns[:], st.netnsPath)
	meta.NetnsCookie = st.NetnsCookie
	meta.SavedFwmarkAccept = st.savedFwmark
	meta.State = state
	if err := d.sock.AePodMeta.Put(st.Slot, &meta); err != nil {
		return fmt.Errorf("write ae_pod_meta: %w", err)
	}
	return nil
}

// writePodMaps writes the per-IP entries, then the netns entry that
// switches outbound capture on, then the journal's "enrolled": a restarted
// agent adopts only a pod whose entries are all in place.
func (d *Dataplane) writePodMaps(st *podState) error {
	p := &Pod{UID: st.UID, Namespace: st.Namespace, Name: st.Name, Interface: st.Interface, IPs: st.IPs, Options: st.Options}
	info := bpfobj.SockPodInfo{NetnsCookie: st.NetnsCookie, Slot: st.Slot, Flags: inspect.OptionFlags(p.Options), Ifindex: st.ifindex}
	for _, ip := range p.IPs {
		// A reused IP gets its new owner (H4), claimIPs having refused
		// a duplicate of a pod that still has it; the old owner's
		// removal checks ownership before deleting.
		if err := d.sock.AePods.Put(bpfobj.AddrKey(ip), &info); err != nil {
			return fmt.Errorf("write ae_pods entry for %s: %w", ip, err)
		}
	}
	ns := p.netnsInfo(st.Slot)
	if err := d.sock.AeNetns.Put(st.NetnsCookie, &ns); err != nil {
		return fmt.Errorf("write ae_netns: %w", err)
	}
	d.cfg.failpoint(StepEnrollEntries)
	return d.writeMeta(st, bpfobj.MetaEnrolled)
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
	d.pruneLocalFlows()
	d.pruneListeners()
}

// deletePodEntries removes every map entry st owns.
func (d *Dataplane) deletePodEntries(st *podState) {
	d.deleteOwnedNetns(st)
	for _, ip := range st.IPs {
		d.deleteOwnedIP(ip, st)
	}
	d.clearSlot(st.Slot)
	d.pruneListeners()
}

func (d *Dataplane) deleteOwnedIP(ip netip.Addr, st *podState) {
	var info bpfobj.SockPodInfo
	if err := d.sock.AePods.Lookup(bpfobj.AddrKey(ip), &info); err != nil {
		return
	}
	if info.NetnsCookie == st.NetnsCookie && info.Slot == st.Slot {
		_ = d.sock.AePods.Delete(bpfobj.AddrKey(ip))
	}
}

func (d *Dataplane) deleteOwnedNetns(st *podState) {
	var ns bpfobj.SockNetnsInfo
	if err := d.sock.AeNetns.Lookup(st.NetnsCookie, &ns); err == nil && ns.Slot == st.Slot {
		_ = d.sock.AeNetns.Delete(st.NetnsCookie)
	}
}

// pruneLocalFlows deletes the ae_local_flows entries (ztunnel's deliveries
// to the app of its own pod, R10) whose app address no pod has in ae_pods
// any more. sockops deletes an entry when its socket closes, but it never
// sees the close of a delivery the pod's lo program filed (one the
// enrolment overtook) that did not connect, nor of one whose pod was
// removed, or whose agent was stopped, in between. Left, such an entry
// would hand a later SYN of the same tuple to a pod with that address
// straight to the app, past ztunnel. The programs file entries only for
// addresses in ae_pods, so none comes back once a pod's entries are gone.
func (d *Dataplane) pruneLocalFlows() {
	var info bpfobj.SockPodInfo
	n := pruneEntries(d, d.sock.AeLocalFlows, func(k *bpfobj.SockSteerKey, _ *uint32) bool {
		return errors.Is(d.sock.AePods.Lookup(k.Daddr, &info), ebpf.ErrKeyNotExist)
	})
	if n > 0 {
		d.log.Debug("pruned ztunnel deliveries of addresses no pod is enrolled with", "entries", n)
	}
}

// pruneEntries deletes the entries of m that stale picks, and returns how
// many it deleted; errors are logged, the next prune tries again.
func pruneEntries[K, V any](d *Dataplane, m *ebpf.Map, stale func(*K, *V) bool) int {
	var (
		k    K
		v    V
		keys []K
	)
	name := m.String()
	it := m.Iterate()
	for it.Next(&k, &v) {
		if stale(&k, &v) {
			keys = append(keys, k)
		}
	}
	if err := it.Err(); err != nil {
		d.log.Warn("prune: iterate", "map", name, "error", err)
	}
	n := 0
	for i := range keys {
		if err := m.Delete(&keys[i]); err == nil {
			n++
		} else if !errors.Is(err, ebpf.ErrKeyNotExist) {
			d.log.Warn("prune: delete", "map", name, "error", err)
		}
	}
	return n
}

func (d *Dataplane) clearSlot(slot uint32) {
	_ = d.sock.AePodMeta.Put(slot, &bpfobj.SockPodMeta{})
}

// Remove takes a pod out of the data path: its traffic flows directly
// again (R16). Removing a pod that is not enrolled is not an error. Entries
// of a reused IP that now belong to another pod are left alone (H4).
func (d *Dataplane) Remove(ctx context.Context, uid string) (err error) {
	defer func() { err = fdlimit.Annotate(err) }()
	if err := ctx.Err(); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st, ok := d.pods[uid]
	if !ok {
		return nil
	}
	err = d.detachPod(st, false)
	delete(d.pods, uid)
	d.slots.release(st.Slot)
	d.restoreSurvivors(st)
	return err
}

// LeaveReturnPaths makes every removal from now on (Remove, Uninstall)
// leave the pods' return-path rule and routes (R10) in their netns: after
// a hand-back, istio-cni's rules use the very same ones.
func (d *Dataplane) LeaveReturnPaths() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.leaveReturnPaths = true
}

// sharedReturnPath says whether the return path in the pod netns at path
// is someone else's too (Config.SharedReturnPath), and so stays.
func (d *Dataplane) sharedReturnPath(path string) bool {
	return d.cfg.SharedReturnPath != nil && d.cfg.SharedReturnPath(path)
}

// detachPod takes everything of the pod away: the journal says "removing"
// first, then outbound capture goes (ae_netns), its other entries, its
// programs and pins, the return path in its netns, and last the journal
// slot. An agent that dies part way leaves "removing" for the next one,
// which finishes the job.
//
// undo says the pod's enrolment was left half done by a dead agent: a
// return path someone else shares (Config.SharedReturnPath) stays then.
func (d *Dataplane) detachPod(st *podState, undo bool) error {
	if err := d.writeMeta(st, bpfobj.MetaRemoving); err != nil {
		d.log.Warn("journal pod removal", "pod", st.Namespace+"/"+st.Name, "error", err)
	}
	d.cfg.failpoint(StepRemoveJournaled)
	d.deleteOwnedNetns(st)
	for _, ip := range st.IPs {
		d.deleteOwnedIP(ip, st)
	}
	d.pruneLocalFlows()
	d.pruneListeners()
	d.cfg.failpoint(StepRemoveEntries)
	for _, l := range st.links {
		if err := l.detach(); err != nil {
			d.log.Warn("detach pod program", "pod", st.Namespace+"/"+st.Name, "error", err)
		}
	}
	st.links = nil
	var errs []error
	if err := os.RemoveAll(podDir(d.cfg, st.UID)); err != nil {
		errs = append(errs, fmt.Errorf("remove pins of pod %s/%s: %w", st.Namespace, st.Name, err))
	}
	d.cfg.failpoint(StepRemoveDetached)
	if st.netnsPath != "" {
		if err := teardownPodNetns(d.cfg.ProcRoot, st.netnsPath, st.savedFwmark, d.leaveReturnPaths || undo && d.sharedReturnPath(st.netnsPath)); err != nil {
			errs = append(errs, fmt.Errorf("pod %s/%s: %w", st.Namespace, st.Name, err))
		}
	}
	d.cfg.failpoint(StepRemoveNetns)
	if len(errs) == 0 {
		d.clearSlot(st.Slot)
	}
	return errors.Join(errs...)
}

// List returns the enrolled pods, sorted by namespace and name.
func (d *Dataplane) List() []inspect.EnrolledPod {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make([]inspect.EnrolledPod, 0, len(d.pods))
	nameOf := func(slot uint32) string {
		for _, p := range d.pods {
			if p.Slot == slot {
				return p.Namespace + "/" + p.Name
			}
		}
		return fmt.Sprintf("(slot %d, not enrolled)", slot)
	}
	for _, p := range d.pods {
		e := p.EnrolledPod
		e.IPs = slices.Clone(e.IPs)
		e.Problem = inspect.Problem(&d.sock.SockMaps, &p.EnrolledPod, nameOf)
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b inspect.EnrolledPod) int {
		if c := strings.Compare(a.Namespace, b.Namespace); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}

// Stats returns a pod's counters.
func (d *Dataplane) Stats(uid string) (inspect.Stats, error) {
	d.mu.Lock()
	st, ok := d.pods[uid]
	d.mu.Unlock()
	if !ok {
		return inspect.Stats{}, fmt.Errorf("pod %s is not enrolled", uid)
	}
	return inspect.ReadStats(&d.sock.SockMaps, st.Slot)
}

// readPods reads the journal's pods (inspect.ReadPods) as the runtime
// keeps them.
func readPods(m *bpfobj.SockMaps) ([]*podState, error) {
	recs, err := inspect.ReadPods(m)
	if err != nil {
		return nil, err
	}
	out := make([]*podState, 0, len(recs))
	for _, r := range recs {
		out = append(out, &podState{EnrolledPod: r.EnrolledPod, netnsPath: r.NetnsPath, savedFwmark: r.SavedFwmark,
			ifindex: r.Ifindex, journal: r.Journal, links: map[string]tcProgram{}})
	}
	return out, nil
}

// adoptPods rebuilds the pod table from the pinned maps after a restart
// and moves each pod's pinned programs to the freshly loaded ones. A pod
// the journal shows part way through enrolment or removal (the agent died
// there) is taken out completely: whoever asked for it asks again (the
// runtime retries a failed CNI ADD; reconcile enrolls live pods), and a
// half-redirected pod is worse than none. Pin directories no journal
// entry names are removed.
func (d *Dataplane) adoptPods() error {
	pods, err := readPods(&d.sock.SockMaps)
	if err != nil {
		return err
	}
	netnsOf := d.netnsFinder(len(pods))
	adopted, undone := 0, 0
	for _, st := range pods {
		d.slots.take(st.Slot)
		st.netnsPath = d.verifiedNetns(st.netnsPath, st.NetnsCookie, netnsOf)
		if st.journal != bpfobj.MetaEnrolled {
			d.log.Info("undoing what a stopped agent left part way", "pod", st.Namespace+"/"+st.Name, "uid", st.UID,
				"state", inspect.JournalName(st.journal), "netns", st.netnsPath)
			st.links = d.pinnedAttachments(st)
			if err := d.detachPod(st, true); err != nil {
				d.log.Warn("undo a partial enrolment", "pod", st.Namespace+"/"+st.Name, "error", err)
			}
			d.slots.release(st.Slot)
			undone++
			continue
		}
		d.adoptLinks(st)
		d.pods[st.UID] = st
		adopted++
	}
	d.repairIPs()
	d.removeOrphanPins()
	d.pruneLocalFlows()
	d.pruneListeners()
	if adopted+undone > 0 {
		d.log.Info("adopted enrolled pods", "count", adopted, "undone", undone)
	}
	return nil
}

// verifiedNetns returns path when it still is the netns with the cookie
// (a /proc/<pid> path may now name another process), else what a scan
// finds, else "".
func (d *Dataplane) verifiedNetns(path string, cookie uint64, netnsOf func(uint64) string) string {
	if path != "" {
		var got uint64
		if nsexec.Do(path, func() (err error) { got, err = d.netnsCookie(); return err }) == nil && got == cookie {
			return path
		}
	}
	return netnsOf(cookie)
}

// podPlan is the plan of an adopted pod: its reroute interfaces are the
// ones its pin directory names.
func (d *Dataplane) podPlan(st *podState) []attachment {
	pod := pinnedPod(podDir(d.cfg, st.UID), st)
	return d.plan(&pod, st.HostInterface, st.Slot)
}

// pinnedPod is the Pod of st with the reroute interfaces its pin
// directory names added to its options.
func pinnedPod(dir string, st *podState) Pod {
	inspect.AddPinnedReroutes(dir, &st.Options)
	return Pod{UID: st.UID, Namespace: st.Namespace, Name: st.Name, Netns: st.netnsPath, Interface: st.Interface, Options: st.Options}
}

// adoptLinks takes over the pod's pinned programs and moves each to the
// freshly loaded program in place. One that cannot be adopted (its
// interface went away with the netns) is left out; the agent's reconcile
// removes or re-enrolls such pods.
func (d *Dataplane) adoptLinks(st *podState) {
	plan := d.podPlan(st)
	// Another layout's programs (an upgrade), or the node-side ones of
	// the SNAT host-probe mode when this agent runs in the direct one.
	d.removeUnplanned(st, plan)
	for _, a := range plan {
		pin := filepath.Join(podDir(d.cfg, st.UID), a.pin)
		if _, err := os.Stat(pin); err != nil {
			if isNodeSide(a.pin) {
				d.attachNodeSide(st, a) // enrolled in the direct mode, adopted in the SNAT one
			}
			if bpfobj.IsCgroupPin(a.pin) {
				d.attachCgroupHook(st, a) // a pin lost; the pod's cgroup is looked for again
			}
			continue
		}
		l, err := d.hooksFor(a).adopt(a, pin)
		if err != nil {
			d.log.Warn("adopted pod has an unusable program", "pod", st.Namespace+"/"+st.Name, "uid", st.UID, "pin", a.pin, "error", err)
			continue
		}
		st.links[a.pin] = l
	}
}

// isNodeSide reports whether a pod pin is a program on the node side of
// the pod's veth (the SNAT host-probe mode's).
func isNodeSide(pin string) bool { return pin == "host_egress" || pin == "host_ingress" }

// attachNodeSide attaches a node-side program an adopted pod lacks: it was
// enrolled while the agent ran in the direct host-probe mode. One that
// cannot be attached leaves the pod's host probes captured, not open.
func (d *Dataplane) attachNodeSide(st *podState, a attachment) {
	l, err := d.attach(st.UID, a)
	if err != nil {
		d.log.Warn("attach the host-probe SNAT to an adopted pod; its probes go through ztunnel", "pod", st.Namespace+"/"+st.Name, "uid", st.UID, "pin", a.pin, "error", err)
		return
	}
	st.links[a.pin] = l
}

// attachCgroupHook attaches a socket program an adopted pod lacks in the
// per-pod mode, to its cgroup found by UID. A pod whose cgroup is gone
// has no sockets to capture.
func (d *Dataplane) attachCgroupHook(st *podState, a attachment) {
	cg, err := hostfs.PodCgroup(d.cfg.PodsCgroup, st.UID)
	if err == nil {
		a.cgroup = cg
		var l tcProgram
		if l, err = d.attach(st.UID, a); err == nil {
			st.links[a.pin] = l
			return
		}
	}
	d.log.Warn("attach a socket program to an adopted pod", "pod", st.Namespace+"/"+st.Name, "uid", st.UID, "pin", a.pin, "error", err)
}

// removeUnplanned detaches the pod's pinned programs this build does not
// plan: an older or newer layout's (an upgrade), or those of the other
// host-probe mode. A link detaches from its pin; a tc program's filter is
// looked for, by its name, on every interface of the pod.
func (d *Dataplane) removeUnplanned(st *podState, plan []attachment) {
	dir := podDir(d.cfg, st.UID)
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if slices.ContainsFunc(plan, func(a attachment) bool { return a.pin == e.Name() }) {
			continue
		}
		pin := filepath.Join(dir, e.Name())
		d.log.Info("removing a pod program this agent does not plan (another layout, or the other host-probe mode)", "pod", st.Namespace+"/"+st.Name, "pin", e.Name())
		if l, err := link.LoadPinnedLink(pin, nil); err == nil {
			_ = detachLink(l)
			continue
		}
		for _, where := range []struct{ netns, iface string }{{st.netnsPath, st.Interface}, {st.netnsPath, "lo"}, {d.cfg.NodeNetns, st.HostInterface}} {
			for _, attach := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				if where.netns == "" || where.iface == "" {
					continue
				}
				f := &tcFilter{a: attachment{pin: e.Name(), netns: where.netns, iface: where.iface, attach: attach}, pin: pin}
				if err := f.detach(); err != nil {
					d.log.Warn("remove a pod program of another layout", "pod", st.Namespace+"/"+st.Name, "pin", e.Name(), "error", err)
				}
			}
		}
	}
}

// pinnedAttachments returns handles that detach whatever of the pod's
// plan may be attached, pinned or not: a filter is found on its interface
// by priority, handle and name; a link needs its pin (an unpinned link
// died with the agent that made it).
func (d *Dataplane) pinnedAttachments(st *podState) map[string]tcProgram {
	out := map[string]tcProgram{}
	for _, a := range d.podPlan(st) {
		pin := filepath.Join(podDir(d.cfg, st.UID), a.pin)
		switch d.hooksFor(a).(type) {
		case netnsHooks, cgroupHooks:
			out[a.pin] = pinnedLink(pin)
			continue
		}
		out[a.pin] = &tcFilter{a: a, pin: pin}
	}
	return out
}

// removeOrphanPins removes pod pin directories that no enrolled pod owns
// (left by an agent of a version without the journal, or by a crash
// between removing a pod's journal entry and its pins, which detachPod
// orders the other way). Links pinned there detach with their pins.
func (d *Dataplane) removeOrphanPins() {
	entries, _ := os.ReadDir(podsDir(d.cfg))
	for _, e := range entries {
		if _, ok := d.pods[e.Name()]; ok {
			continue
		}
		d.log.Warn("removing pins no enrolled pod owns", "dir", filepath.Join(podsDir(d.cfg), e.Name()))
		_ = os.RemoveAll(filepath.Join(podsDir(d.cfg), e.Name()))
	}
}

// slotAllocator hands out indexes into ae_pod_meta and ae_stats.
type slotAllocator struct {
	used [bpfobj.MaxPods]bool
	next uint32
}

func (s *slotAllocator) alloc() (uint32, bool) {
	for i := uint32(0); i < bpfobj.MaxPods; i++ {
		slot := (s.next + i) % bpfobj.MaxPods
		if !s.used[slot] {
			s.used[slot] = true
			s.next = slot + 1
			return slot, true
		}
	}
	return 0, false
}

func (s *slotAllocator) take(slot uint32) {
	if slot < bpfobj.MaxPods {
		s.used[slot] = true
	}
}

func (s *slotAllocator) release(slot uint32) {
	if slot < bpfobj.MaxPods {
		s.used[slot] = false
	}
}
