// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zdsclient

import (
	"context"
	"os"

	"istio.io/istio/pkg/zdsapi"
)

// PodSet is a proxy that serves pods by uid; the ztunnel stand-in's Proxy
// (AddPod, DelPod, Pods) has this shape.
type PodSet interface {
	// AddPod starts serving uid inside netns (the descriptor is valid only
	// during the call); adding a pod again replaces it.
	AddPod(uid string, netns *os.File) error
	// DelPod stops serving uid; unknown uids are ignored.
	DelPod(uid string)
	// Pods returns the uids served.
	Pods() []string
}

// HandlerFor adapts a PodSet to Handler the way ztunnel behaves: Keep keeps
// what is there, and SnapshotSent drops every pod the snapshot did not name.
func HandlerFor(p PodSet) Handler { return podSetHandler{p} }

type podSetHandler struct{ p PodSet }

func (h podSetHandler) Add(_ context.Context, uid string, _ *zdsapi.WorkloadInfo, netns *os.File) error {
	return h.p.AddPod(uid, netns)
}

func (h podSetHandler) Keep(context.Context, string) error { return nil }

func (h podSetHandler) Del(_ context.Context, uid string) error {
	h.p.DelPod(uid)
	return nil
}

func (h podSetHandler) SnapshotSent(_ context.Context, snapshot []string) error {
	named := make(map[string]bool, len(snapshot))
	for _, uid := range snapshot {
		named[uid] = true
	}
	for _, uid := range h.p.Pods() {
		if !named[uid] {
			h.p.DelPod(uid)
		}
	}
	return nil
}
