// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/cilium/ebpf/btf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// Config is the node-wide configuration of the data path.
type Config struct {
	// BPFFSDir is the directory all pins live under; it must be on a bpffs.
	BPFFSDir string
	// CgroupRoot is the cgroup v2 directory the socket hooks attach to. Every
	// pod and ztunnel must be below it (on a node: the hierarchy's root).
	CgroupRoot string
	// PodsCgroup, when set, is the cgroup v2 directory below CgroupRoot that
	// holds every pod, ztunnel's included (kubelet's kubepods.slice or
	// kubepods). The socket programs then attach there, so that enrolled
	// pods' sockets meet them before any program at CgroupRoot, whichever
	// attached first (a socket load balancer: Cilium's rewrites a Service
	// address to a backend's, and ztunnel would be handed the backend);
	// a node-wide half (connect and sockops, for the node's own sockets:
	// host probes) attaches to CgroupRoot where the kernel refuses fentry
	// on tcp_connect() (bpf/probe.c files them elsewhere). Empty: every
	// program at CgroupRoot. Changed between two agents, the second moves
	// the links.
	PodsCgroup string
	// SocketHooks is where enrolled pods' socket programs attach. Empty
	// or SocketHooksShared: once, on PodsCgroup (or the root), where every
	// socket below it meets them, in the mesh or not. SocketHooksPods: on
	// each enrolled pod's cgroup (Pod.Cgroup, else found by UID below
	// PodsCgroup) and on ztunnel's (AttachZtunnel), so that sockets of
	// what is not in the mesh meet none of them (only the node-wide half
	// on the root, where the kernel refuses fentry); it needs PodsCgroup.
	// A pod's cgroup is below its ancestors', so its programs run before
	// any at the root, whenever attached. Pins of the shared mode with
	// pods enrolled are refused: ztunnel's cgroup is not known until it
	// connects, and its reads of original destinations would miss the
	// programs meanwhile.
	SocketHooks SocketHooks
	// NodeNetns is the node's network namespace, where the node side of
	// each pod's veth is (default: the agent's own, /proc/self/ns/net).
	NodeNetns string
	// ProcRoot is a procfs mount; pod sysctls are written through it.
	// /proc/sys/net answers for the netns of the thread that opens it,
	// whichever procfs mount it is opened through, so a container whose
	// own /proc/sys is read-only uses the host's /proc mounted elsewhere.
	// Default /proc.
	ProcRoot string
	// ProbeV4 and ProbeV6 are the host-probe SNAT addresses (R7, R8).
	ProbeV4, ProbeV6 netip.Addr
	// HostProbes is how the node's own connections to enrolled pods
	// (kubelet's probes) reach the app: bpfobj.ProbeDirect (default), with
	// the node's address, or bpfobj.ProbeSNAT, from ProbeV4/ProbeV6 as
	// istio-cni does. Changed between two agents, pods already enrolled
	// take the new mode as the second one adopts them.
	HostProbes bpfobj.ProbeMode
	// SockmapAccel accelerates the hop between an app and ztunnel inside
	// each enrolled pod with sockhashes and an sk_msg program
	// (bpf/accel.c): both ends being sockets of the pod's netns, a send on
	// one is queued onto the other's receive queue without TCP. Off by
	// default (docs/BENCHMARKS.md says why). It needs Linux 5.15 (package
	// features: sockmap_accel); elsewhere it is ignored with a warning and
	// the hop stays on TCP. Changed or turned off after it was on,
	// connections already accelerated keep what they had until they close.
	SockmapAccel accel.Mode
	// SharedReturnPath, when set, says whether the return path in the pod
	// netns at the path given is someone else's too: istio-cni's, while a
	// takeover from it is under way (its redirected connections' replies
	// take the same policy rule). Undoing a half-done enrolment, in a
	// rollback or after a crash, then leaves the return path in place, or
	// those replies would leave the pod while it is enrolled again. A
	// removal takes it, as istio-cni's own removal would. Unset: never.
	SharedReturnPath func(netns string) bool `json:"-"`
	Logger           *slog.Logger
	// UnreadOrigDstWait bounds how long Uninstall, having ended capture,
	// waits for ztunnel to read the original destinations of connections
	// captured just before (SO_ORIGINAL_DST, answered by the program that
	// is about to go). Default 5 s; ztunnel reads one right after its
	// accept, so the wait is usually milliseconds, or nothing.
	UnreadOrigDstWait time.Duration
	// Failpoint, when set, is called at each step of enrolment and
	// removal with the step's name (see Steps), and of Uninstall
	// (StepUninstallCaptureEnded). The crash-injection tests kill the
	// process there; nothing else sets it.
	Failpoint func(step string) `json:"-"`
	// KernelBTF, when set, is the kernel's BTF decoded once for every
	// New of a process that creates many data paths (the test suites);
	// unset, each New decodes it once for its own loads.
	KernelBTF *btf.Cache `json:"-"`
}

// Steps are the failpoints of Enroll and Remove, in order: after each the
// node is in a state a crash may leave, and a restarted agent must finish
// or undo it.
var Steps = []string{
	StepEnrollJournaled, StepEnrollReturnPath, StepEnrollAttached, StepEnrollEntries, StepEnrollDone,
	StepRemoveJournaled, StepRemoveEntries, StepRemoveDetached, StepRemoveNetns,
}

// The failpoints (Config.Failpoint).
const (
	StepEnrollJournaled  = "enroll/journaled"   // the slot says enrolling; nothing else changed
	StepEnrollReturnPath = "enroll/return-path" // policy rule, route and sysctl set in the pod
	StepEnrollAttached   = "enroll/attached"    // after each program (called once per program)
	StepEnrollEntries    = "enroll/entries"     // ae_pods and ae_netns written, journal not yet "enrolled"
	StepEnrollDone       = "enroll/done"        // enrolled
	StepRemoveJournaled  = "remove/journaled"   // the slot says removing
	StepRemoveEntries    = "remove/entries"     // map entries gone
	StepRemoveDetached   = "remove/detached"    // programs and pins gone
	StepRemoveNetns      = "remove/netns"       // rule, route and sysctl restored; slot not yet freed
)

// StepUninstallCaptureEnded is Uninstall's failpoint: no pod is captured
// any more, its programs and pins are all still there. Not among Steps:
// a crash there leaves an uninstall half done, which the next agent
// adopts as it adopts any node.
const StepUninstallCaptureEnded = "uninstall/capture-ended"

func (c *Config) failpoint(step string) {
	if c.Failpoint != nil {
		c.Failpoint(step)
	}
}

func (c *Config) setDefaults() error {
	if c.BPFFSDir == "" {
		c.BPFFSDir = bpfobj.DefaultBPFFSDir
	}
	if c.CgroupRoot == "" {
		return fmt.Errorf("no cgroup root configured")
	}
	if c.PodsCgroup != "" {
		root, pods := filepath.Clean(c.CgroupRoot), filepath.Clean(c.PodsCgroup)
		if !strings.HasPrefix(pods, root+"/") {
			return fmt.Errorf("pods cgroup %s is not below the cgroup root %s", c.PodsCgroup, c.CgroupRoot)
		}
		c.PodsCgroup = pods
	}
	switch c.SocketHooks {
	case "":
		c.SocketHooks = SocketHooksShared
	case SocketHooksShared:
	case SocketHooksPods:
		if c.PodsCgroup == "" {
			return fmt.Errorf("socket hooks %q need a pods cgroup", c.SocketHooks)
		}
	default:
		return fmt.Errorf("socket hooks %q: want %q or %q", c.SocketHooks, SocketHooksShared, SocketHooksPods)
	}
	if c.ProcRoot == "" {
		c.ProcRoot = "/proc"
	}
	if c.NodeNetns == "" {
		c.NodeNetns = "/proc/self/ns/net"
	}
	if !c.ProbeV4.IsValid() {
		c.ProbeV4 = bpfobj.DefaultProbeV4
	}
	if !c.ProbeV6.IsValid() {
		c.ProbeV6 = bpfobj.DefaultProbeV6
	}
	if !c.ProbeV4.Is4() {
		return fmt.Errorf("probe address %s is not IPv4", c.ProbeV4)
	}
	if !c.ProbeV6.Is6() || c.ProbeV6.Is4In6() {
		return fmt.Errorf("probe address %s is not IPv6", c.ProbeV6)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.UnreadOrigDstWait <= 0 {
		c.UnreadOrigDstWait = 5 * time.Second
	}
	probes, err := bpfobj.ParseProbeMode(string(c.HostProbes))
	if err != nil {
		return err
	}
	c.HostProbes = probes
	mode, err := accel.ParseMode(string(c.SockmapAccel))
	if err != nil {
		return err
	}
	c.SockmapAccel = mode
	return nil
}

// bpfConfig is what the programs see in ae_cfg.
func (c *Config) bpfConfig() bpfobj.SockAeConfig {
	cfg := bpfobj.DefaultConfig(c.ProbeV4, c.ProbeV6)
	cfg.ReturnMark = returnMark
	if c.HostProbes == bpfobj.ProbeDirect {
		cfg.Flags |= bpfobj.CfgProbeDirect
	}
	return cfg
}

// SocketHooks is where enrolled pods' socket programs attach
// (Config.SocketHooks).
type SocketHooks string

const (
	// SocketHooksShared: one set on the pods' cgroup (or the root).
	SocketHooksShared SocketHooks = "shared"
	// SocketHooksPods: a set on each enrolled pod's cgroup and on
	// ztunnel's.
	SocketHooksPods SocketHooks = "pods"
)
