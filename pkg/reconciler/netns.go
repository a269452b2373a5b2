// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
)

// netnsScans shares scans of /proc among pods. A node runs thousands of
// processes, and a scan per pod repaired 7 pods a second with 8300 of
// them; so each scan indexes every pod's netns, and serves every pod
// reported before it began: such a pod's process (it is running) was
// there to be found. Scans are numbered; a pod asks for one numbered at
// least what next said when it was reported, so a backlog of pods costs
// one scan, and a pod reported later, or not found and retried, gets a
// newer one. What an older scan found is checked (Current) before use.
type netnsScans struct {
	finder NetnsFinder

	mu      sync.Mutex
	started uint64 // scans begun
	gen     uint64 // the number of the scan index holds
	index   map[types.UID]podnetns.NetNS
	running chan struct{} // closed when the scan under way ends; nil: none
}

// next is the number of the next scan to begin: the first that sees a
// process running now.
func (s *netnsScans) next() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.started + 1
}

// find returns the netns of pod uid from a scan numbered at least after.
func (s *netnsScans) find(ctx context.Context, uid types.UID, after uint64) (podnetns.NetNS, error) {
	rescanned := false
	for {
		index, err := s.since(ctx, after)
		if err != nil {
			return podnetns.NetNS{}, err
		}
		ns, ok := index[uid]
		if !ok {
			return podnetns.NetNS{}, fmt.Errorf("pod uid %s: %w", uid, podnetns.ErrNotFound)
		}
		if s.finder.Current(uid, ns) {
			return ns, nil
		}
		if rescanned {
			return podnetns.NetNS{}, fmt.Errorf("pod uid %s: its process exited: %w", uid, podnetns.ErrNotFound)
		}
		// The process the scan found exited since: a new scan finds
		// the pod's other processes, if any.
		rescanned, after = true, s.next()
	}
}

// since returns the index of a scan numbered at least after: the last
// one, the one under way once it ends, or a new one.
func (s *netnsScans) since(ctx context.Context, after uint64) (map[types.UID]podnetns.NetNS, error) {
	for {
		index, running := s.lookup(after)
		switch {
		case index != nil:
			return index, nil
		case running != nil:
			select {
			case <-running:
			case <-ctx.Done():
				return nil, fmt.Errorf("wait for the scan of /proc: %w", ctx.Err())
			}
		default:
			if err := s.scan(ctx); err != nil {
				return nil, err
			}
		}
	}
}

// lookup returns the index when its scan is numbered at least after, or
// else the scan under way (nil: none).
func (s *netnsScans) lookup(after uint64) (map[types.UID]podnetns.NetNS, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.index != nil && s.gen >= after {
		return s.index, nil
	}
	return nil, s.running
}

// scan scans /proc and keeps the index, unless another scan began
// meanwhile (the caller waits for that one).
func (s *netnsScans) scan(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("scan /proc: %w", err)
	}
	s.mu.Lock()
	if s.running != nil {
		s.mu.Unlock()
		return nil
	}
	s.started++
	gen, running := s.started, make(chan struct{})
	s.running = running
	s.mu.Unlock()
	index, err := s.finder.Scan(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.running = nil
	close(running)
	if err != nil {
		return err
	}
	s.index, s.gen = index, gen
	return nil
}

// findNetns returns the netns of the pod with uid, known under key, from
// a scan that can see it. When none is found, the pod's retry asks for a
// newer scan than the one that missed it.
func (r *Reconciler) findNetns(ctx context.Context, key string, uid types.UID) (podnetns.NetNS, error) {
	r.mu.Lock()
	after := r.desired[key].scan
	r.mu.Unlock()
	ns, err := r.netns.find(ctx, uid, after)
	if errors.Is(err, podnetns.ErrNotFound) {
		next := r.netns.next()
		r.mu.Lock()
		if d, ok := r.desired[key]; ok && d.scan < next {
			d.scan = next
			r.desired[key] = d
		}
		r.mu.Unlock()
	}
	return ns, err
}
