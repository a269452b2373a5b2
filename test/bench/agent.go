// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
)

// agent times the dataplane API (enroll_latency): it owns a dataplane of
// its own in a process of its own, in the node netns, with pins in a
// directory of the node's bpffs beside the node agent's and socket hooks on
// an empty cgroup, so nothing it enrolls meets the node agent's state.
type agent struct {
	dp *dataplane.Dataplane
}

type agentRequest struct {
	Op     string           `json:"op"` // new, enroll, remove, uninstall
	Config dataplane.Config `json:"config,omitzero"`
	Pods   []dataplane.Pod  `json:"pods,omitempty"`
	UIDs   []string         `json:"uids,omitempty"`
}

// enrollResult times each Enroll call, from the request to redirection
// in place (Enroll returns once the pod's netns entry is written).
type enrollResult struct {
	Latencies []time.Duration `json:"latencies"`
	Total     time.Duration   `json:"total"`
}

// memResult is the node agent's memory: resident set now and at its peak,
// and the kernel memory charged to the pinned maps.
type memResult struct {
	RSSBytes  int64
	AnonBytes int64 // of RSS: anonymous memory (heap, stacks)
	HWMBytes  int64
	MapBytes  int64
	MapsCount int
}

// progStat is one BPF program's run count and time (kernel.bpf_stats_enabled).
type progStat struct {
	Name    string
	Runs    uint64
	Runtime time.Duration
}

func (a *agent) handle(line []byte) (any, error) {
	req, err := decode[agentRequest](line)
	if err != nil {
		return nil, err
	}
	if req.Op != "new" && a.dp == nil {
		return nil, errors.New("no dataplane loaded")
	}
	switch req.Op {
	case "new":
		a.dp, err = dataplane.New(req.Config)
		return nil, err
	case "enroll":
		res := enrollResult{Latencies: make([]time.Duration, 0, len(req.Pods))}
		start := time.Now()
		for _, p := range req.Pods {
			t0 := time.Now()
			if err := a.dp.Enroll(context.Background(), p); err != nil {
				return nil, err
			}
			res.Latencies = append(res.Latencies, time.Since(t0))
		}
		res.Total = time.Since(start)
		return res, nil
	case "remove":
		for _, uid := range req.UIDs {
			if err := a.dp.Remove(context.Background(), uid); err != nil {
				return nil, err
			}
		}
		return nil, nil
	case "uninstall":
		err := a.dp.Uninstall()
		a.dp = nil
		return nil, err
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

// close leaves the node clean when the benchmark ends early.
func (a *agent) close() {
	if a.dp != nil {
		_ = a.dp.Uninstall()
	}
}

// procMemory reads a process's memory (/proc/<pid>/status).
func procMemory(pid int) (memResult, error) {
	var m memResult
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return m, err
	}
	m.RSSBytes = statusKiB(string(status), "VmRSS:") << 10
	m.HWMBytes = statusKiB(string(status), "VmHWM:") << 10
	m.AnonBytes = statusKiB(string(status), "RssAnon:") << 10
	return m, nil
}

// memory reads a process's memory and that of the maps pinned under bpffs.
func memory(pid int, bpffs string) (memResult, error) {
	m, err := procMemory(pid)
	if err != nil {
		return m, err
	}
	err = filepath.WalkDir(filepath.Join(bpffs, "maps"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		mp, err := ebpf.LoadPinnedMap(path, &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			return fmt.Errorf("open map %s: %w", path, err)
		}
		defer mp.Close()
		info, err := mp.Info()
		if err != nil {
			return fmt.Errorf("map %s: %w", path, err)
		}
		memlock, ok := info.Memlock()
		if !ok {
			return fmt.Errorf("map %s: the kernel reports no memlock", path)
		}
		m.MapBytes += int64(memlock)
		m.MapsCount++
		return nil
	})
	return m, err
}

// statusKiB reads a "Key:   123 kB" line of /proc/<pid>/status.
func statusKiB(status, key string) int64 {
	for l := range strings.Lines(status) {
		if rest, ok := strings.CutPrefix(l, key); ok {
			v, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return v
		}
	}
	return 0
}

// pinnedProgram opens the program pinned at path, or the program of the
// link pinned there.
func pinnedProgram(path string) (*ebpf.Program, error) {
	if prog, err := ebpf.LoadPinnedProgram(path, nil); err == nil {
		return prog, nil
	}
	l, err := link.LoadPinnedLink(path, nil)
	if err != nil {
		return nil, fmt.Errorf("open pin %s: %w", path, err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return nil, fmt.Errorf("link %s: %w", path, err)
	}
	prog, err := ebpf.NewProgramFromID(info.Program)
	if err != nil {
		return nil, fmt.Errorf("program of %s: %w", path, err)
	}
	return prog, nil
}

// progStats sums run counts and times per program name over every link
// pinned under bpffs.
func progStats(bpffs string) ([]progStat, error) {
	byName := map[string]*progStat{}
	var order []string
	seen := map[ebpf.ProgramID]bool{}
	err := filepath.WalkDir(bpffs, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || strings.Contains(path, "/maps/") {
			return err
		}
		// Links and tc programs live under links/ and pods/; the root
		// also holds the layout record (ae_layout), a map.
		if rel, _ := filepath.Rel(bpffs, path); !strings.HasPrefix(rel, "links/") && !strings.HasPrefix(rel, "pods/") {
			return nil
		}
		// A pin is a link (cgroup hooks, sk_lookup) or the program of a
		// classic tc filter.
		prog, err := pinnedProgram(path)
		if err != nil {
			return err
		}
		defer prog.Close()
		pi, err := prog.Info()
		if err != nil {
			return fmt.Errorf("program of %s: %w", path, err)
		}
		id, _ := pi.ID()
		if seen[id] {
			return nil
		}
		seen[id] = true
		s := byName[pi.Name]
		if s == nil {
			s = &progStat{Name: pi.Name}
			byName[pi.Name] = s
			order = append(order, pi.Name)
		}
		st, err := prog.Stats()
		if err != nil {
			return fmt.Errorf("program of %s: %w", path, err)
		}
		s.Runs += st.RunCount
		s.Runtime += st.Runtime
		return nil
	})
	out := make([]progStat, 0, len(order))
	for _, name := range order {
		out = append(out, *byName[name])
	}
	return out, err
}
