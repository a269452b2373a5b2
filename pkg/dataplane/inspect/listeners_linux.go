// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"fmt"
	"slices"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// ListenerStatus is the state of ae_listeners, ztunnel's inbound
// listeners by netns (R5; the sk_lookup mode only).
type ListenerStatus struct {
	// Entries is how many listeners are filed, of Capacity.
	Entries  int `json:"entries"`
	Capacity int `json:"capacity"`
	// NotEnrolled is how many of them are of a netns that is not
	// enrolled (the agent prunes them).
	NotEnrolled int `json:"notEnrolled"`
	// Missing names the enrolled pods (namespace/name) none of whose
	// listeners is filed: their inbound connections are refused until
	// ztunnel listens there (it has not been handed the pod yet, or is
	// down) and the listener is filed.
	Missing []string `json:"missing,omitempty"`
	// Pruned and Refiled count what a resync did: entries of netns not
	// enrolled deleted, pods whose listener it filed.
	Pruned  int `json:"pruned,omitempty"`
	Refiled int `json:"refiled,omitempty"`
}

// ReadListenerStatus reads ae_listeners against the enrolled pods (by
// netns cookie: their namespace/name).
func ReadListenerStatus(m *bpfobj.SockMaps, pods map[uint64]string) (ListenerStatus, error) {
	st := ListenerStatus{Capacity: int(m.AeListeners.MaxEntries())}
	filed := map[uint64]bool{}
	var (
		k bpfobj.SockListenerKey
		v uint64
	)
	it := m.AeListeners.Iterate()
	for it.Next(&k, &v) {
		st.Entries++
		filed[k.NetnsCookie] = true
		if _, ok := pods[k.NetnsCookie]; !ok {
			st.NotEnrolled++
		}
	}
	if err := it.Err(); err != nil {
		return st, fmt.Errorf("read ae_listeners: %w", err)
	}
	for cookie, name := range pods {
		if !filed[cookie] {
			st.Missing = append(st.Missing, name)
		}
	}
	slices.Sort(st.Missing)
	return st, nil
}

// Listeners reads ae_listeners against the pods enrolled in the pins; the
// status is empty (Capacity 0) where the data path does not use it (before
// Linux 5.17, inbound goes through tc).
func (p *Pinned) Listeners() (ListenerStatus, error) {
	if !readNodeConfig(&p.maps).skLookupInbound {
		return ListenerStatus{}, nil
	}
	pods, err := p.Pods()
	if err != nil {
		return ListenerStatus{}, err
	}
	byNetns := map[uint64]string{}
	for _, e := range pods {
		byNetns[e.NetnsCookie] = e.Namespace + "/" + e.Name
	}
	return ReadListenerStatus(&p.maps, byNetns)
}
