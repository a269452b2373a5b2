// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package doctor is the node preflight behind `ambient-ebpf doctor`: what
// a platform engineer checks on a node before and after installing
// ambient-ebpf. It only reads: kernel features, the cgroup v2 and bpffs
// mounts, the pinned data path, the CNI configuration as the runtime will
// read it, ztunnel's socket, and other software on the hooks the data path
// uses (cgroup socket hooks, pods' tc hooks, istio-cni's iptables rules).
// Every finding says what it means and what to do.
package doctor

import (
	"context"
	"fmt"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// Status grades a finding.
type Status string

// Statuses, mildest first.
const (
	OK   Status = "ok"
	Info Status = "info" // worth knowing; nothing is wrong
	Warn Status = "warn" // something may break; read what it means
	Fail Status = "fail" // ambient-ebpf cannot work as installed
)

// Finding is one result.
type Finding struct {
	// Check names what was looked at: kernel, feature/<name>, cgroup2,
	// bpffs, datapath, cgroup-hooks, tc-hooks, host-probes, cni, ztunnel,
	// istio-cni, agent.
	Check   string `json:"check"`
	Status  Status `json:"status"`
	Summary string `json:"summary"`
	// Meaning says what the finding means for redirection, Action what
	// to do about it.
	Meaning string `json:"meaning,omitempty"`
	Action  string `json:"action,omitempty"`
}

// Report is every finding, in the order the checks ran.
type Report struct {
	Findings []Finding      `json:"findings"`
	Counts   map[Status]int `json:"counts"`
}

// Failed reports whether any check failed.
func (r *Report) Failed() bool { return r.Counts[Fail] > 0 }

// Config says where to look; the defaults are a node's.
type Config struct {
	// BPFFSDir is the data path's pin directory (bpfobj.DefaultBPFFSDir).
	BPFFSDir string
	// CgroupRoot is the agent's --cgroup-root; empty: the cgroup2 mount.
	CgroupRoot string
	// NodeNetns is the netns of the pods' host-side veths and of the node's
	// iptables rules; empty: the doctor's own.
	NodeNetns string
	// CNIConfDir is the host's CNI configuration directory (/etc/cni/net.d).
	CNIConfDir string
	// ZDSSocket is ztunnel's socket (/var/run/ztunnel/ztunnel.sock).
	ZDSSocket string
	// ProcRoot is a procfs mount (/proc), for /proc/net/unix.
	ProcRoot string
	// MaxCgroups bounds the cgroup tree walk (default 10000).
	MaxCgroups int
	// Agent asks the running agent for its status; nil: not asked.
	Agent func(ctx context.Context) (*inspectv1.StatusResponse, error)
}

func (c *Config) setDefaults() {
	if c.BPFFSDir == "" {
		c.BPFFSDir = bpfobj.DefaultBPFFSDir
	}
	if c.CNIConfDir == "" {
		c.CNIConfDir = "/etc/cni/net.d"
	}
	if c.ZDSSocket == "" {
		c.ZDSSocket = zds.DefaultSocketPath
	}
	if c.ProcRoot == "" {
		c.ProcRoot = "/proc"
	}
	if c.MaxCgroups == 0 {
		c.MaxCgroups = 10000
	}
}

// node is what the checks share: the config and the pins, if any.
type node struct {
	cfg     Config
	pinned  *inspect.Pinned // nil when nothing is pinned
	pinErr  error
	dump    *inspect.MapDump
	cgroup2 string // the cgroup root the hooks attach to; empty when none
}

// Run runs every check.
func Run(ctx context.Context, cfg Config) *Report {
	cfg.setDefaults()
	n := &node{cfg: cfg}
	n.pinned, n.pinErr = inspect.OpenPinned(cfg.BPFFSDir)
	if n.pinned != nil {
		defer n.pinned.Close()
		n.dump, n.pinErr = n.pinned.Dump()
		if n.pinErr != nil {
			n.pinned.Close()
			n.pinned = nil
		}
	}
	r := &Report{Counts: map[Status]int{}}
	for _, check := range []func(context.Context, *node) []Finding{
		checkKernel, checkFeatures, checkCgroup2, checkBPFFS, checkDataPath, checkCgroupHooks,
		checkTCHooks, checkHostProbes, checkCNI, checkZtunnel, checkIstioCNI, checkAgent,
	} {
		for _, f := range check(ctx, n) {
			r.Findings = append(r.Findings, f)
			r.Counts[f.Status]++
		}
	}
	return r
}

// list joins up to max items, saying how many more there are.
func list(items []string, max int) string {
	if len(items) <= max {
		return strings.Join(items, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(items[:max], ", "), len(items)-max)
}
