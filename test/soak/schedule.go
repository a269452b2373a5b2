// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// fault is a kind of step of the schedule.
type fault string

// The faults, and how often each is drawn (weights).
const (
	agentKill     fault = "agent_sigkill"    // SIGKILL, restart after a pause
	agentTerm     fault = "agent_sigterm"    // SIGTERM (DaemonSet kept), restart
	ztunnelRoll   fault = "ztunnel_restart"  // a new ztunnel connects, the old one exits
	ztunnelCrash  fault = "ztunnel_crash"    // ztunnel exits, a new one starts after a pause
	ztunnelFlaky  fault = "ztunnel_flaky"    // a ztunnel slow to ack, NACKing its first adds, takes over
	zdsDrop       fault = "zds_drop"         // ztunnel's ZDS connection breaks, its listeners stay
	apiOutage     fault = "apiserver_outage" // kube-apiserver SIGKILLed, back after a pause
	apiAndAgent   fault = "apiserver_outage_agent_restart"
	podAdd        fault = "pod_add"        // a new pod through the CNI plugin (IP reuse included)
	podDel        fault = "pod_del"        // a churn pod deleted: CNI DEL, API delete
	podLabelOut   fault = "pod_label_none" // a churn pod labelled out of the mesh
	podLabelIn    fault = "pod_label_back" // ... and back in
	podAddAgentDn fault = "pod_add_agent_down"
	releaseSwitch fault = "release_switch"   // a rollback to the last release, or the upgrade back to HEAD
	dnsFlip       fault = "dns_capture_flip" // a fixed pod's ambient.istio.io/dns-capture flipped
)

type weight struct {
	f fault
	w int
}

var weights = []weight{
	{agentKill, 3}, {agentTerm, 2}, {ztunnelRoll, 2}, {ztunnelCrash, 1}, {ztunnelFlaky, 1}, {zdsDrop, 2},
	{apiOutage, 1}, {apiAndAgent, 1}, {podAdd, 4}, {podDel, 3},
	{podLabelOut, 2}, {podLabelIn, 2}, {podAddAgentDn, 1}, {releaseSwitch, 1}, {dnsFlip, 1},
}

func faultNames() string {
	var names []string
	for _, w := range weights {
		names = append(names, string(w.f))
	}
	return strings.Join(names, ", ")
}

// schedule draws the faults and the pauses between and within them from
// a seed: the same seed gives the same sequence of draws.
type schedule struct {
	seed uint64
	rng  *rand.Rand
	only map[fault]bool // the kinds drawn; empty: every kind
}

func newSchedule(seed uint64, only ...fault) *schedule {
	s := &schedule{seed: seed, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), only: map[fault]bool{}}
	for _, f := range only {
		s.only[f] = true
	}
	return s
}

func (s *schedule) drawn(f fault) bool { return len(s.only) == 0 || s.only[f] }

// next draws the next fault.
func (s *schedule) next() fault {
	total := 0
	for _, w := range weights {
		if s.drawn(w.f) {
			total += w.w
		}
	}
	n := s.rng.IntN(total)
	for _, w := range weights {
		if !s.drawn(w.f) {
			continue
		}
		if n < w.w {
			return w.f
		}
		n -= w.w
	}
	panic("unreachable")
}

// pause draws a duration in [lo, hi).
func (s *schedule) pause(lo, hi time.Duration) time.Duration {
	return lo + time.Duration(s.rng.Int64N(int64(hi-lo)))
}

// pick draws an index below n.
func (s *schedule) pick(n int) int { return s.rng.IntN(n) }

// settings are the soak's knobs, from the environment.
type settings struct {
	duration time.Duration
	seed     uint64
	report   string  // where the JSON report goes; empty: the test's temp dir
	only     []fault // SOAK_FAULTS: the kinds drawn (a fault's replay); empty: all
}

const defaultDuration = 100 * time.Second

func readSettings() (settings, error) {
	s := settings{duration: defaultDuration, seed: uint64(time.Now().UnixNano()), report: os.Getenv("SOAK_REPORT")}
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			return s, fmt.Errorf("SOAK_DURATION=%q: want a positive duration such as 90s or 1h", v)
		}
		s.duration = d
	}
	if v := os.Getenv("SOAK_FAULTS"); v != "" {
		for _, name := range strings.Split(v, ",") {
			f := fault(strings.TrimSpace(name))
			if !slices.ContainsFunc(weights, func(w weight) bool { return w.f == f }) {
				return s, fmt.Errorf("SOAK_FAULTS: no fault %q; the faults: %s", f, faultNames())
			}
			s.only = append(s.only, f)
		}
	}
	if v := os.Getenv("SOAK_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return s, fmt.Errorf("SOAK_SEED=%q: want an unsigned integer", v)
		}
		s.seed = n
	}
	return s, nil
}
