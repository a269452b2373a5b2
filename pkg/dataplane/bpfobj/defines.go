// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bpfobj

import (
	"fmt"
	"net/netip"
	"time"
)

// The #define constants of bpf/include/common.h, copied by hand (bpf2go
// generates types and enums, not macros); TestConstantsMatchCommonH holds
// them to the C side.
const (
	// ae_pods and ae_netns flags (AE_F_*).
	FlagHasV4         = 1 << 0
	FlagHasV6         = 1 << 1
	FlagBypassInbound = 1 << 2
	FlagDNSCapture    = 1 << 3

	// ae_cfg.flags bits (AE_CFG_*).
	CfgNetnsCookieSockops = 1 << 0
	CfgNetnsCookieSockopt = 1 << 1
	CfgSkAssignReuseport  = 1 << 2
	CfgSkLookupIfindex    = 1 << 3
	CfgProbeDirect        = 1 << 4
	CfgNodeScope          = 1 << 5
	CfgProbeConnect       = 1 << 6

	// ProbeFlowTTL is AE_PROBE_FLOW_TTL_NS: how long after its connect a
	// host probe's filed flow (direct mode) lets its SYN through; the
	// agent sweeps older entries no SYN used.
	ProbeFlowTTL = 10 * time.Second

	// ListenerSlots is AE_LISTENER_SLOTS: ae_listeners' slots per pod and
	// port.
	ListenerSlots = 4

	// Journal states of a pod's ae_pod_meta slot (AE_META_*).
	MetaFree      = 0
	MetaEnrolled  = 1
	MetaEnrolling = 2
	MetaRemoving  = 3

	// MaxPods is how many pods the data path can enrol: AE_MAX_PODS, the
	// size of its per-pod maps.
	MaxPods = 8192

	// TraceLost is AE_TRACE_LOST: the last ae_decisions slot, counting
	// trace events dropped because the ring was full.
	TraceLost = 31
)

// Defaults of the ambient contract: what the agent configures unless told
// otherwise, and what a reader assumes of pins that do not say.
const (
	DefaultBPFFSDir     = "/sys/fs/bpf/ambient-ebpf"
	DefaultZtunnelMark  = 0x539
	DefaultMarkMask     = 0xfff
	DefaultOutboundPort = 15001
	DefaultInboundPort  = 15006
	DefaultHBONEPort    = 15008
	DefaultDNSPort      = 15053
	DefaultInterface    = "eth0"
)

// Default host-probe SNAT addresses (contract section 1).
var (
	DefaultProbeV4 = netip.MustParseAddr("169.254.7.127")
	DefaultProbeV6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// UnpinnedMap reports whether a map of the objects is, on purpose, kept
// per load and never pinned: ae_sk_probe, whose marks live only from a
// node socket's connect to its sockops callback (bpf/sock.c).
func UnpinnedMap(name string) bool { return name == "ae_sk_probe" }

// TraceFlagMap is the pin name, under maps/, of the data section holding
// ae_tracing (bpf/trace.h): the flag that switches trace events on.
const TraceFlagMap = "ae_tracing"

// DefaultConfig is ae_cfg with the contract's defaults and the probe
// addresses given; the agent adds its return mark and its flags.
func DefaultConfig(probe4, probe6 netip.Addr) SockAeConfig {
	cfg := SockAeConfig{
		ZtunnelMark:  DefaultZtunnelMark,
		MarkMask:     DefaultMarkMask,
		OutboundPort: DefaultOutboundPort,
		InboundPort:  DefaultInboundPort,
		HbonePort:    DefaultHBONEPort,
		DnsPort:      DefaultDNSPort,
	}
	cfg.ProbeV4.B = probe4.As16()
	cfg.ProbeV6.B = probe6.As16()
	return cfg
}

// ProbeMode is how connections from the node's own sockets (kubelet's
// probes) reach an enrolled pod's app, past ztunnel (contract rows H1-H4).
type ProbeMode string

// Host-probe modes.
const (
	// ProbeDirect lets them through untranslated, with the node's address
	// as source: the node socket files its flow as it connects, and the
	// pod's programs pass exactly that flow. Nothing is attached on the
	// node side of the pod's veth. The default.
	ProbeDirect ProbeMode = "direct"
	// ProbeSNAT translates their source to the probe address
	// (169.254.7.127), which the pod's programs pass, as istio-cni does.
	ProbeSNAT ProbeMode = "snat"
)

// ParseProbeMode reads a mode's name; "" is the default, direct.
func ParseProbeMode(s string) (ProbeMode, error) {
	switch m := ProbeMode(s); m {
	case "":
		return ProbeDirect, nil
	case ProbeDirect, ProbeSNAT:
		return m, nil
	}
	return "", fmt.Errorf("host-probe mode %q: want %q or %q", s, ProbeDirect, ProbeSNAT)
}

// ProbeModeOf is the mode ae_cfg's flags say the programs run in.
func ProbeModeOf(flags uint32) ProbeMode {
	if flags&CfgProbeDirect != 0 {
		return ProbeDirect
	}
	return ProbeSNAT
}
