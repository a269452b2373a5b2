// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// countEntries counts the entries of the map pinned as name under the
// pins' maps folder; -1 when it cannot be read.
func countEntries(bpffsDir, name string) int {
	m, err := ebpf.LoadPinnedMap(filepath.Join(bpfobj.MapsDir(bpffsDir), name), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return -1
	}
	defer m.Close()
	n := 0
	key, next := make([]byte, m.KeySize()), make([]byte, m.KeySize())
	var cur any // nil: the first key
	for {
		if err := m.NextKey(cur, &next); err != nil {
			if errors.Is(err, ebpf.ErrKeyNotExist) {
				return n
			}
			return -1
		}
		n++
		copy(key, next)
		cur = key
	}
}

// metric reads one unlabelled series of the agent's /metrics, or -1.
func (s *soak) metric(name string) int {
	code, body := s.r.Get("/metrics")
	if code != 200 {
		return -1
	}
	for line := range strings.Lines(body) {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
				return int(f)
			}
		}
	}
	return -1
}

// podFilters counts our tc filters (bpfobj.TCFilterPriority) on a pod's
// interfaces, in its netns, and on the node side of its veth, by
// interface and hook; a pod whose netns is gone has none.
func (s *soak) podFilters(p *simnode.Pod) (map[string]int, error) {
	out := map[string]int{}
	count := func(nsPath string, only string) error {
		ns, err := netns.GetFromPath(nsPath)
		if err != nil {
			if errors.Is(err, unix.ENOENT) {
				return nil
			}
			return err
		}
		defer ns.Close()
		h, err := netlink.NewHandleAt(ns)
		if err != nil {
			return err
		}
		defer h.Close()
		links, err := h.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			if only != "" && l.Attrs().Name != only {
				continue
			}
			for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
				fs, err := h.FilterList(l, parent)
				if err != nil {
					continue // no clsact qdisc: no filter
				}
				for _, f := range fs {
					if f.Attrs().Priority == bpfobj.TCFilterPriority {
						out[fmt.Sprintf("%s/%x", l.Attrs().Name, parent)]++
					}
				}
			}
		}
		return nil
	}
	if err := count(p.NetnsPath(), ""); err != nil {
		return nil, fmt.Errorf("pod %s netns: %w", p.Name, err)
	}
	if err := count(simnode.NetnsPath(s.r.NodeNS), p.HostVeth); err != nil {
		return nil, fmt.Errorf("pod %s node side: %w", p.Name, err)
	}
	return out, nil
}

// tcFilters counts our tc filters on every pod the soak made that is
// still there; -1 when one cannot be read.
func (s *soak) tcFilters() int {
	s.mu.Lock()
	var sps []*simnode.Pod
	for _, p := range s.pods {
		if !p.gone && p.sp != nil {
			sps = append(sps, p.sp)
		}
	}
	s.mu.Unlock()
	n := 0
	for _, sp := range sps {
		by, err := s.podFilters(sp)
		if err != nil {
			return -1
		}
		for _, c := range by {
			n += c
		}
	}
	return n
}

// checkFilters holds the pods' tc filters after convergence: none on a
// pod out of the mesh, at most one per interface and hook, and the same
// on every pod in the mesh.
func (s *soak) checkFilters() {
	s.mu.Lock()
	pods := append([]*pod(nil), s.pods...)
	s.mu.Unlock()
	in := -1
	for _, p := range pods {
		s.mu.Lock()
		gone, want := p.gone, p.wantIn
		s.mu.Unlock()
		if gone || p.sp == nil {
			continue
		}
		by, err := s.podFilters(p.sp)
		if err != nil {
			s.fail("after convergence: %v", err)
			continue
		}
		total := 0
		for hook, c := range by {
			total += c
			if c > 1 {
				s.fail("after convergence, pod %s has %d of our tc filters on %s", p.name, c, hook)
			}
		}
		switch {
		case !want && total > 0:
			s.fail("after convergence, pod %s, out of the mesh, keeps our tc filters: %v", p.name, by)
		case want && in < 0:
			in = total
		case want && total != in:
			s.fail("after convergence, pods in the mesh have %d and %d of our tc filters (%s: %v)", in, total, p.name, by)
		}
	}
}
