// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// report is what a run leaves: its seed, the faults by kind and in order,
// the samples by outcome, the convergence time and the leak series.
type report struct {
	Seed        uint64            `json:"seed"`
	Duration    string            `json:"duration"`
	Started     time.Time         `json:"started"`
	Faults      map[string]int    `json:"faults"`
	Log         []string          `json:"log"`
	Samples     map[string]string `json:"samples"`
	Violations  []string          `json:"violations,omitempty"`
	Convergence string            `json:"convergence"`
	Leaks       []leakPoint       `json:"leaks"`

	mu sync.Mutex
}

// leakPoint is one measurement of what could leak: the running agent's
// file descriptors (and of them, netns references), resident memory and
// threads; the pins and the pods they hold; the pods that should be in.
type leakPoint struct {
	At       string `json:"at"` // since the start
	AgentPID int    `json:"agentPid"`
	FDs      int    `json:"fds"`
	NetnsFDs int    `json:"netnsFds"`
	RSSKiB   int    `json:"rssKiB"`
	Threads  int    `json:"threads"`
	// NodePins are the pins outside pods/ (the node's programs, links
	// and maps); PodDirs the pods' folders below pods/.
	NodePins int `json:"nodePins"`
	PodDirs  int `json:"podDirs"`
	// Map entries: ae_pods (an address each), ae_netns, the pod records
	// (ae_pod_meta; not journalled enrolled: NotEnrolled), ae_orig_dst.
	PodAddrs    int `json:"podAddrs"`
	Netns       int `json:"netns"`
	PodRecords  int `json:"podRecords"`
	NotEnrolled int `json:"notEnrolled"`
	OrigDst     int `json:"origDst"`
	PinnedPods  int `json:"pinnedPods"`
	// AgentEnrolled is the agent's own count (ambient_ebpf_enrolled_pods);
	// -1 when its metrics did not answer.
	AgentEnrolled int `json:"agentEnrolled"`
	WantIn        int `json:"wantIn"`
	// Goroutines (go_goroutines) and Listeners
	// (ambient_ebpf_listener_table_entries) are the agent's own, -1 when
	// its metrics did not answer; LocalFlows counts ae_local_flows;
	// TCFilters our tc filters on the soak's pods, both sides of the veth.
	Goroutines int `json:"goroutines"`
	Listeners  int `json:"listeners"`
	LocalFlows int `json:"localFlows"`
	TCFilters  int `json:"tcFilters"`
}

func newReport(s settings) *report {
	return &report{Seed: s.seed, Duration: s.duration.String(), Started: time.Now(), Faults: map[string]int{}}
}

func (r *report) fault(f fault, did string, took time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.Faults[string(f)]++
	r.Log = append(r.Log, fmt.Sprintf("%s %s: %s (%s)", time.Since(r.Started).Round(time.Millisecond), f, did, took.Round(time.Millisecond)))
}

func (r *report) leak(p leakPoint) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p.At = time.Since(r.Started).Round(time.Second).String()
	r.Leaks = append(r.Leaks, p)
}

// leakSample measures the running agent and the pins.
func (s *soak) leakSample() leakPoint {
	var lp leakPoint
	if s.r.Agent != nil && !s.r.Agent.Exited() {
		lp.AgentPID = s.r.Agent.PID()
		dir := fmt.Sprintf("/proc/%d/fd", lp.AgentPID)
		if fds, err := os.ReadDir(dir); err == nil {
			lp.FDs = len(fds)
			for _, fd := range fds {
				if l, err := os.Readlink(filepath.Join(dir, fd.Name())); err == nil && strings.HasPrefix(l, "net:") {
					lp.NetnsFDs++
				}
			}
		}
		lp.RSSKiB, lp.Threads = procStatus(lp.AgentPID)
	}
	podsDir := bpfobj.PodsDir(s.r.BPFFSDir)
	_ = filepath.WalkDir(s.r.BPFFSDir, func(path string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
		case d.IsDir() && filepath.Dir(path) == podsDir:
			lp.PodDirs++
		case !d.IsDir() && !strings.HasPrefix(path, podsDir+"/"):
			lp.NodePins++
		}
		return nil
	})
	if view, err := inspect.OpenPinned(s.r.BPFFSDir); err == nil {
		if d, err := view.Dump(); err == nil {
			lp.PodAddrs, lp.Netns, lp.PodRecords, lp.OrigDst = len(d.Pods), len(d.Netns), len(d.Meta), len(d.OrigDst)
			for _, m := range d.Meta {
				if m.State != "enrolled" {
					lp.NotEnrolled++
				}
			}
		}
		if pods, err := view.Pods(); err == nil {
			lp.PinnedPods = len(pods)
		}
		view.Close()
	}
	lp.AgentEnrolled = s.agentEnrolled()
	lp.Goroutines, lp.Listeners = s.metric("go_goroutines"), s.metric("ambient_ebpf_listener_table_entries")
	lp.LocalFlows = countEntries(s.r.BPFFSDir, bpfobj.TcMapAeLocalFlows)
	lp.TCFilters = s.tcFilters()
	s.mu.Lock()
	for _, p := range s.pods {
		if !p.gone && p.wantIn {
			lp.WantIn++
		}
	}
	s.mu.Unlock()
	return lp
}

// agentEnrolled is the agent's gauge of enrolled pods, or -1.
func (s *soak) agentEnrolled() int {
	code, body := s.r.Get("/metrics")
	if code != 200 {
		return -1
	}
	for line := range strings.Lines(body) {
		if v, ok := strings.CutPrefix(line, "ambient_ebpf_enrolled_pods "); ok {
			if n, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
				return int(n)
			}
		}
	}
	return -1
}

// procStatus reads VmRSS (KiB) and Threads of a process.
func procStatus(pid int) (rssKiB, threads int) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		n, _ := strconv.Atoi(strings.Fields(v + " 0")[0])
		switch k {
		case "VmRSS":
			rssKiB = n
		case "Threads":
			threads = n
		}
	}
	return rssKiB, threads
}

// checkLeaks holds the last measurement, taken after convergence, to
// what the pods in the mesh need: the agent holds no netns of a pod gone
// or out of the mesh, and the pins hold exactly the pods in.
func (s *soak) checkLeaks() {
	s.rep.mu.Lock()
	first, last := s.rep.Leaks[0], s.rep.Leaks[len(s.rep.Leaks)-1]
	s.rep.mu.Unlock()
	n := last.WantIn
	if last.PinnedPods != n || last.PodDirs != n || last.Netns != n || last.PodRecords != n || last.PodAddrs != 2*n || last.NotEnrolled != 0 {
		s.fail("after convergence, with %d pods in the mesh, the pins and maps hold more or less: %+v", n, last)
	}
	if last.AgentEnrolled != n {
		s.fail("after convergence, with %d pods in the mesh, the agent counts %d enrolled (ambient_ebpf_enrolled_pods)", n, last.AgentEnrolled)
	}
	if last.NodePins != first.NodePins {
		s.fail("the node's pins went from %d to %d over the run", first.NodePins, last.NodePins)
	}
	// The node's netns and one per pod in the mesh, at most.
	if last.NetnsFDs > last.WantIn+1 {
		s.fail("the agent holds %d netns references with %d pods in the mesh: %+v", last.NetnsFDs, last.WantIn, last)
	}
	s.checkFilters()
	// ae_listeners: at most AE_LISTENER_SLOTS (4) per pod in the mesh,
	// as of the agent's last resync; an entry of a pod gone or out is a
	// leak. ae_local_flows: ztunnel's open deliveries to an app, none
	// once the sampler has stopped but for a straggler; one per
	// connection that ended is a leak.
	if last.Listeners > 4*n {
		s.fail("after convergence, with %d pods in the mesh, ae_listeners holds %d entries", n, last.Listeners)
	}
	if last.LocalFlows > 4*n {
		s.fail("after convergence, with %d pods in the mesh, ae_local_flows holds %d entries", n, last.LocalFlows)
	}
}

// writeReport writes the report as JSON to SOAK_REPORT (or the test's
// temporary folder) and logs its summary.
func (s *soak) writeReport() {
	r := s.rep
	r.mu.Lock()
	defer r.mu.Unlock()
	path := s.set.report
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		s.t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		s.t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		s.t.Fatal(err)
	}
	var faults, samples []string
	for k, n := range r.Faults {
		faults = append(faults, fmt.Sprintf("%s %d", k, n))
	}
	for k, v := range r.Samples {
		samples = append(samples, k+": "+v)
	}
	sort.Strings(faults)
	sort.Strings(samples)
	var first, last leakPoint
	if len(r.Leaks) > 0 {
		first, last = r.Leaks[0], r.Leaks[len(r.Leaks)-1]
	}
	s.t.Logf("soak report %s\nseed %d, %s\nfaults: %s\nsamples:\n  %s\nconvergence after the last fault: %s\nleaks, first and last: %+v\n  %+v",
		path, r.Seed, r.Duration, strings.Join(faults, ", "), strings.Join(samples, "\n  "), r.Convergence, first, last)
}
