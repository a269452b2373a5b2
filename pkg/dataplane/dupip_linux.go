// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
)

// ErrDuplicateIP is what Enroll returns for a pod with an address another
// enrolled pod still has: ae_pods holds one owner per address, and the
// newcomer taking it would end the running pod's inbound capture (H4).
var ErrDuplicateIP = errors.New("duplicate pod IP")

// claimIPs decides who gets pod's addresses before anything is changed.
// An address whose ae_pods entry names another enrolled pod is refused
// while that pod still has it (its netns, the one of its recorded cookie,
// has the address on an interface): a duplicate IP (an IPAM fault, static
// IPs, a forged prevResult) must never take a running pod's capture away.
// An owner that no longer has it (its netns is gone, or its interface
// went with its sandbox) is stale: a DEL was missed and the address was
// reused (H4); such owners are returned for the caller to remove. Entries
// of the pod's own UID (a new sandbox) and entries no pod owns are the
// newcomer's to overwrite.
func (d *Dataplane) claimIPs(pod *Pod, cookie uint64) ([]*podState, error) {
	var stale []*podState
	for _, ip := range pod.IPs {
		var info bpfobj.SockPodInfo
		if err := d.sock.AePods.Lookup(bpfobj.AddrKey(ip), &info); err != nil {
			continue
		}
		owner := d.ownerOf(info)
		if info.NetnsCookie == cookie || owner == nil || owner.UID == pod.UID || slices.Contains(stale, owner) {
			continue
		}
		if d.holdsAddr(owner, ip) {
			return nil, fmt.Errorf("pod %s/%s (uid %s): %w: %s is pod %s/%s's (uid %s), which still has it in its netns %s",
				pod.Namespace, pod.Name, pod.UID, ErrDuplicateIP, ip, owner.Namespace, owner.Name, owner.UID, owner.netnsPath)
		}
		stale = append(stale, owner)
	}
	return stale, nil
}

// ownerOf returns the enrolled pod an ae_pods entry names, nil for none.
func (d *Dataplane) ownerOf(info bpfobj.SockPodInfo) *podState {
	for _, st := range d.pods {
		if st.Slot == info.Slot && st.NetnsCookie == info.NetnsCookie {
			return st
		}
	}
	return nil
}

// holdsAddr reports whether the pod's netns still exists and has ip on
// an interface. Where its recorded path no longer names the netns of its
// cookie (a /proc path whose process went), a scan of the node's netns
// looks for it: an owner still running must never pass for stale. A netns
// that is not found counts as gone.
func (d *Dataplane) holdsAddr(st *podState, ip netip.Addr) bool {
	held, ok := d.netnsHas(st.netnsPath, st.NetnsCookie, ip)
	if !ok {
		path := d.netnsFinder(1)(st.NetnsCookie)
		if path == "" {
			return false
		}
		st.netnsPath = path
		held, _ = d.netnsHas(path, st.NetnsCookie, ip)
	}
	return held
}

// netnsHas reports whether the netns at path, when it is the one of
// cookie (ok), has ip on an interface; one whose addresses cannot be read
// counts as having it.
func (d *Dataplane) netnsHas(path string, cookie uint64, ip netip.Addr) (held, ok bool) {
	if path == "" {
		return false, false
	}
	err := nsexec.Do(path, func() error {
		got, err := d.netnsCookie()
		if err != nil || got != cookie {
			return err
		}
		ok = true
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netlink: %w", err)
		}
		defer h.Close()
		family := netlink.FAMILY_V4
		if ip.Is6() {
			family = netlink.FAMILY_V6
		}
		addrs, err := h.AddrList(nil, family)
		if err != nil {
			return fmt.Errorf("list addresses: %w", err)
		}
		held = slices.ContainsFunc(addrs, func(a netlink.Addr) bool {
			got, valid := netip.AddrFromSlice(a.IP)
			return valid && got.Unmap() == ip
		})
		return nil
	})
	if err != nil && ok {
		// The netns is the pod's but its addresses cannot be read: it
		// counts as having it (the newcomer is refused, retried).
		d.log.Warn("check a pod's address in its netns", "netns", path, "ip", ip, "error", err)
		return true, true
	}
	return held, ok
}

// removeStale takes out a pod whose address another pod is being
// enrolled with and which no longer has it (claimIPs). It is not undone
// if the newcomer's enrolment fails: the pod is gone either way.
func (d *Dataplane) removeStale(st *podState, by *Pod) {
	d.log.Warn("removing a pod whose address another pod is enrolled with: it no longer has it (its DEL was missed)",
		"pod", st.Namespace+"/"+st.Name, "uid", st.UID, "ips", st.IPs, "netns", st.netnsPath, "by", by.Namespace+"/"+by.Name)
	if err := d.detachPod(st, false); err != nil {
		d.log.Warn("remove stale pod", "pod", st.Namespace+"/"+st.Name, "error", err)
	}
	delete(d.pods, st.UID)
	d.slots.release(st.Slot)
}

// restoreSurvivors gives the addresses a removed pod's entries had back
// to another enrolled pod that claims them and whose entry is missing:
// only an adopted inconsistent state (two owners, see repairIPs) has one.
func (d *Dataplane) restoreSurvivors(gone *podState) {
	for _, ip := range gone.IPs {
		if err := d.sock.AePods.Lookup(bpfobj.AddrKey(ip), new(bpfobj.SockPodInfo)); !errors.Is(err, ebpf.ErrKeyNotExist) {
			continue
		}
		for _, st := range d.pods {
			if st != gone && slices.Contains(st.IPs, ip) {
				d.putIP(st, ip)
				break
			}
		}
	}
}

// putIP writes st's ae_pods entry for ip.
func (d *Dataplane) putIP(st *podState, ip netip.Addr) {
	p := &Pod{Options: st.Options}
	info := bpfobj.SockPodInfo{NetnsCookie: st.NetnsCookie, Slot: st.Slot, Flags: inspect.OptionFlags(p.Options), Ifindex: st.ifindex}
	if err := d.sock.AePods.Put(bpfobj.AddrKey(ip), &info); err != nil {
		d.log.Warn("restore ae_pods entry", "pod", st.Namespace+"/"+st.Name, "ip", ip, "error", err)
		return
	}
	d.log.Info("restored a pod's ae_pods entry", "pod", st.Namespace+"/"+st.Name, "uid", st.UID, "ip", ip)
}

// repairIPs restores, after adoption, the ae_pods entries of enrolled pods
// that the journal and ae_netns say they have and ae_pods does not give
// them (an agent before ErrDuplicateIP let a duplicate's removal delete
// them): missing entries are written again; one another enrolled pod
// owns is taken back when that pod no longer has the address and this
// one does. Two pods that both have it are left, and reported (problem).
func (d *Dataplane) repairIPs() {
	for _, st := range d.pods {
		if st.ifindex == 0 && st.netnsPath != "" {
			_ = nsexec.Do(st.netnsPath, func() error {
				i, err := nsexec.IfindexByName(st.Interface)
				st.ifindex = uint32(i)
				return err
			})
		}
		for _, ip := range st.IPs {
			var info bpfobj.SockPodInfo
			err := d.sock.AePods.Lookup(bpfobj.AddrKey(ip), &info)
			switch {
			case err == nil && info.NetnsCookie == st.NetnsCookie && info.Slot == st.Slot:
				continue
			case err == nil:
				o := d.ownerOf(info)
				if o != nil && (d.holdsAddr(o, ip) || !d.holdsAddr(st, ip)) {
					d.log.Error("two enrolled pods claim one address; inbound capture of one of them is lost until it is removed and added again",
						"ip", ip, "pod", st.Namespace+"/"+st.Name, "owner", o.Namespace+"/"+o.Name)
					continue
				}
				if o != nil {
					o.IPs = slices.DeleteFunc(slices.Clone(o.IPs), func(a netip.Addr) bool { return a == ip })
				}
			case !errors.Is(err, ebpf.ErrKeyNotExist):
				continue
			}
			d.putIP(st, ip)
		}
	}
}
