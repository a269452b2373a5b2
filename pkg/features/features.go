// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package features probes, once per process, the kernel features the data
// path uses and the kernel each needs. The dataplane picks its mechanisms
// from these answers (TCX or classic tc, ...), the agent logs the Report at
// start and the CLI shows it. Probes ask the kernel (a program load, a
// syscall), never the version number: vendor kernels backport features.
package features

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
)

// MinimumKernel is the oldest Linux release the data path runs on: the
// oldest one tested; every Required feature is older (docs/KERNELS.md).
const MinimumKernel = "5.10"

// Feature is one probed kernel capability.
type Feature struct {
	// Name is short and stable: it is logged and shown by the CLI.
	Name string
	// Kernel is the first upstream Linux release that has it.
	Kernel string
	// Use says what the data path does with it.
	Use string
	// Without says what the data path does instead where the kernel
	// lacks it, and what that costs.
	Without string
	// Required features have no fallback: without them the data path
	// refuses to start, naming the kernel they need.
	Required bool
	// Has reports whether the running kernel has it (probed once).
	Has func() bool
}

// Refusable reports whether a kernel as new as f.Kernel may refuse f all
// the same, by policy rather than by build: BPF trampolines (fentry) are
// refused under some BPF LSM policies and lockdown setups, as on the
// machine CI runs on.
func (f Feature) Refusable() bool { return f.Name == "fentry_tcp_connect" }

// Status is a Feature's probed answer.
type Status struct {
	Name      string `json:"name"`
	Kernel    string `json:"kernel"`
	Use       string `json:"use"`
	Without   string `json:"without"`
	Required  bool   `json:"required"`
	Available bool   `json:"available"`
}

// All lists every probed feature, oldest kernel first.
func All() []Feature {
	const refuse = "the agent refuses to start: there is no fallback"
	return []Feature{
		{"fentry_tcp_connect", "5.5", "direct host probes (H1): an fentry program on tcp_connect() files the node's probes, one call per connect; nothing of ours runs for the node's other sockets (arm64: Linux 6.0; refused under some BPF LSM policies)",
			"a connect and a sockops program on the node's cgroup root file them: every TCP connection of the node runs them, about ten calls", false, HasFentryTCPConnect},
		{"sk_assign", "5.7", "tc: hand inbound flows to ztunnel's listener (bpf_sk_assign)", refuse, true, HasSkAssign},
		{"netns_cookie_sock_addr", "5.7", "connect/sendmsg hooks: scope capture to enrolled pods", refuse, true, HasNetnsCookieSockAddr},
		{"cgroup_getpeername", "5.8", "getpeername hooks: a redirected socket names its original peer", refuse, true, HasCgroupGetpeername},
		{"sk_storage_sock_addr", "5.8", "connect hooks: keep the original destination with the socket", refuse, true, HasSkStorageSockAddr},
		{"sk_storage_sockops", "5.8", "sockops: file the original destination for SO_ORIGINAL_DST", refuse, true, HasSkStorageSockops},
		{"sk_lookup", "5.9", "pod netns: hand inbound flows to ztunnel's reuseport listeners where tc cannot", refuse, true, HasSkLookup},
		{"so_netns_cookie", "5.14", "read a pod's netns cookie with getsockopt",
			"a cgroup bind4 hook on the agent's own cgroup reports each pod's netns cookie (one more program, a bind per enrolment)", false, HasSONetnsCookie},
		{"netns_cookie_sockops", "5.15", "sockops: scope SO_ORIGINAL_DST entries by netns; with sk_lookup_ifindex, file ztunnel's listeners for sk_lookup",
			"SO_ORIGINAL_DST entries are keyed by the client's address alone, and inbound capture needs a tc program on every pod's interface", false, HasNetnsCookieSockops},
		{"netns_cookie_sockopt", "5.15", "getsockopt: scope SO_ORIGINAL_DST lookups by netns",
			"lookups by address alone; ztunnel's accepted sockets in any netns get their own local address, which ztunnel falls back to anyway", false, HasNetnsCookieSockopt},
		{"sockmap_accel", "5.15", "--sockmap-accel: the hop between an app and ztunnel in its pod skips TCP (sockhash and sk_msg)",
			"the hop stays on TCP over the pod's lo; --sockmap-accel logs a warning and does nothing", false, HasSockmapAccel},
		{"sk_lookup_ifindex", "5.17", "pod netns: sk_lookup alone captures inbound flows (no tc program on the pod's interface)",
			"a tc program on each pod's interface runs for every inbound packet and files new flows for sk_lookup", false, HasSkLookupIfindex},
		{"tcx", "6.6", "marks the kernels (6.5+) whose tc bpf_sk_assign takes reuseport listeners (R14 hand-over from tc)",
			"R14 flows and SYNs over TIME_WAIT sockets are handed over through ae_steer and sk_lookup (one more map write per such flow)", false, HasTCX},
		{"sockmap_link", "6.10", "--sockmap-accel: the sk_msg program is attached to ae_accel by a pinned bpf_link",
			"the program is attached to the map itself (BPF_PROG_ATTACH) and lives as long as the pinned map", false, HasSockmapLink},
	}
}

// Report probes every feature (cached) and returns the answers.
func Report() []Status {
	all := All()
	out := make([]Status, len(all))
	for i, f := range all {
		out[i] = Status{Name: f.Name, Kernel: f.Kernel, Use: f.Use, Without: f.Without, Required: f.Required, Available: f.Has()}
	}
	return out
}

// Log writes the report, one line per feature, for the agent's start-up log.
func Log(log *slog.Logger) {
	for _, s := range Report() {
		log.Info("kernel feature", "name", s.Name, "available", s.Available, "kernel", s.Kernel, "required", s.Required)
	}
}

// CheckRequired returns an error naming every required feature the kernel
// lacks and the Linux release that brings it.
func CheckRequired() error {
	var errs []error
	for _, f := range All() {
		if f.Required && !f.Has() {
			errs = append(errs, fmt.Errorf("ambient-ebpf needs Linux %s for %s (%s)", f.Kernel, f.Name, f.Use))
		}
	}
	return errors.Join(errs...)
}

// String renders the report as an aligned table (the CLI's status).
func String(report []Status) string {
	var b strings.Builder
	for _, s := range report {
		mark := "no"
		if s.Available {
			mark = "yes"
		}
		fmt.Fprintf(&b, "%-24s %-4s Linux %-5s %s\n", s.Name, mark, s.Kernel, s.Use)
	}
	return b.String()
}
