// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"fmt"
	"slices"
)

// Decision is what a hook did with a connection.
type Decision uint8

// Decisions.
const (
	DecisionNone       Decision = iota
	DecisionCaptured            // sent to one of ztunnel's listeners
	DecisionPassed              // left alone
	DecisionDropped             // refused (fail closed)
	DecisionTranslated          // a host probe's source rewritten (H1)
	DecisionError               // the data path could not do its part
)

var decisionNames = [...]string{"none", "captured", "passed", "dropped", "translated", "error"}

func (d Decision) String() string {
	if int(d) < len(decisionNames) {
		return decisionNames[d]
	}
	return "unknown"
}

// MarshalText makes JSON show the name.
func (d Decision) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (d *Decision) UnmarshalText(b []byte) error { return unmarshalName(b, decisionNames[:], d) }

// Reason says why a hook decided what it did. Each reason implies its
// decision and names the contract row it comes from.
type Reason uint8

// Reasons; the numbers are enum ae_reason in bpf/include/common.h (a test checks).
const (
	ReasonNone            Reason = iota
	ReasonNotEnrolled            // the socket's netns or the address is no enrolled pod's
	ReasonZtunnelMark            // the socket carries ztunnel's mark
	ReasonLoopback               // to 127.0.0.0/8 or ::1
	ReasonOwnIP                  // to the pod's own address
	ReasonProbeDest              // to the host-probe address
	ReasonUDPNotDNS              // UDP to a port other than 53
	ReasonDNSCaptureOff          // DNS, but the pod's DNS capture is off
	ReasonNotTCP                 // neither TCP nor UDP
	ReasonOutbound               // outbound TCP to ztunnel's :15001
	ReasonDNS                    // DNS to ztunnel's proxy on :15053
	ReasonOrigDstError           // the original destination could not be kept: connect() fails
	ReasonInbound                // inbound TCP to ztunnel's :15006
	ReasonIngressMode            // the pod bypasses inbound capture
	ReasonHBONE                  // to ztunnel's HBONE port 15008
	ReasonFromPod                // from the pod itself (over lo)
	ReasonZtunnelDelivery        // ztunnel delivering to the app with the client's address
	ReasonProbeSource            // from the host-probe address
	ReasonNoListener             // no ztunnel listener to hand the flow to
	ReasonAssignError            // the kernel refused the hand-over
	ReasonReroute                // TCP from a virtual interface to ztunnel's :15001
	ReasonProbeSNAT              // a host probe, translated to the probe address
	ReasonForwarded              // forwarded to the pod, no local socket
	ReasonProbePortTaken         // the probe's port is another prober's translation
	ReasonProbeTableFull         // no room for the translation
	ReasonRewriteError           // the packet could not be rewritten
	ReasonOrigDstFull            // ae_orig_dst is full: ztunnel cannot read SO_ORIGINAL_DST
	ReasonLocalFlowFull          // ae_local_flows is full: the delivery may be captured
	ReasonListenerFull           // ae_listeners is full: ztunnel's listener was not filed
	ReasonProbeDirect            // a host probe: the flow a node socket filed (direct mode)
	reasonCount
)

type reasonInfo struct {
	name     string
	decision Decision
	row      string
	text     string
}

var reasonInfos = [reasonCount]reasonInfo{
	ReasonNone:            {"none", DecisionNone, "", ""},
	ReasonNotEnrolled:     {"not_enrolled", DecisionPassed, "R16", "not an enrolled pod"},
	ReasonZtunnelMark:     {"ztunnel_mark", DecisionPassed, "R2", "ztunnel's own socket (mark 0x539)"},
	ReasonLoopback:        {"loopback", DecisionPassed, "R3", "to a loopback address"},
	ReasonOwnIP:           {"own_ip", DecisionPassed, "R4", "to the pod's own address"},
	ReasonProbeDest:       {"probe_destination", DecisionPassed, "R8", "to the host-probe address"},
	ReasonUDPNotDNS:       {"udp_not_dns", DecisionPassed, "R11", "UDP other than DNS"},
	ReasonDNSCaptureOff:   {"dns_capture_off", DecisionPassed, "R13", "DNS, with the pod's DNS capture off"},
	ReasonNotTCP:          {"not_tcp", DecisionPassed, "R11", "neither TCP nor UDP"},
	ReasonOutbound:        {"outbound", DecisionCaptured, "R1", "outbound TCP to ztunnel's :15001"},
	ReasonDNS:             {"dns", DecisionCaptured, "R9", "DNS to ztunnel's proxy"},
	ReasonOrigDstError:    {"orig_dst_error", DecisionError, "R1", "the original destination could not be kept: connect() fails"},
	ReasonInbound:         {"inbound", DecisionCaptured, "R5", "inbound TCP to ztunnel's :15006"},
	ReasonIngressMode:     {"ingress_mode", DecisionPassed, "R12", "the pod bypasses inbound capture"},
	ReasonHBONE:           {"hbone_port", DecisionPassed, "R6", "to ztunnel's HBONE port"},
	ReasonFromPod:         {"from_pod", DecisionPassed, "R4", "from the pod itself"},
	ReasonZtunnelDelivery: {"ztunnel_delivery", DecisionPassed, "R10", "ztunnel delivering to the app"},
	ReasonProbeSource:     {"probe_source", DecisionPassed, "R7", "from the host-probe address"},
	ReasonNoListener:      {"no_listener", DecisionDropped, "R5", "no ztunnel listener in the pod (fail closed)"},
	ReasonAssignError:     {"assign_error", DecisionDropped, "R5", "the kernel refused the hand-over to ztunnel"},
	ReasonReroute:         {"reroute", DecisionCaptured, "R14", "TCP from a virtual interface to ztunnel's :15001"},
	ReasonProbeSNAT:       {"probe_snat", DecisionTranslated, "H1", "a host probe, from the probe address"},
	ReasonForwarded:       {"forwarded", DecisionPassed, "H2", "forwarded through the node, no local socket"},
	ReasonProbePortTaken:  {"probe_port_taken", DecisionPassed, "H1", "the port is another prober's translation: untranslated"},
	ReasonProbeTableFull:  {"probe_table_full", DecisionError, "H1", "ae_probe_nat is full: untranslated"},
	ReasonRewriteError:    {"rewrite_error", DecisionDropped, "H1", "the packet could not be rewritten"},
	ReasonOrigDstFull:     {"orig_dst_table_full", DecisionError, "R1", "ae_orig_dst is full: ztunnel cannot read SO_ORIGINAL_DST"},
	ReasonLocalFlowFull:   {"local_flow_table_full", DecisionError, "R10", "ae_local_flows is full: ztunnel's delivery may be captured"},
	ReasonListenerFull:    {"listener_table_full", DecisionError, "R5", "ae_listeners is full: ztunnel's listener was not filed (the agent's resync files it when room returns)"},
	ReasonProbeDirect:     {"probe_direct", DecisionPassed, "H1", "a host probe from a node socket, with the node's address (direct mode)"},
}

func (r Reason) info() reasonInfo {
	if r < reasonCount {
		return reasonInfos[r]
	}
	return reasonInfo{name: "unknown"}
}

func (r Reason) String() string { return r.info().name }

// Decision is the decision the reason implies.
func (r Reason) Decision() Decision { return r.info().decision }

// Row is the contract row the reason comes from (R1 ... H4).
func (r Reason) Row() string { return r.info().row }

// Text says the reason in a few words.
func (r Reason) Text() string { return r.info().text }

// MarshalText makes JSON show the name.
func (r Reason) MarshalText() ([]byte, error) { return []byte(r.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (r *Reason) UnmarshalText(b []byte) error {
	names := make([]string, reasonCount)
	for i := range names {
		names[i] = reasonInfos[i].name
	}
	return unmarshalName(b, names, r)
}

// Reasons lists every reason, for metrics that must show zero counts.
func Reasons() []Reason {
	out := make([]Reason, 0, reasonCount-1)
	for r := ReasonNone + 1; r < reasonCount; r++ {
		out = append(out, r)
	}
	return out
}

// Hook is where a decision is made.
type Hook uint8

// Hooks; the numbers are enum ae_hook in bpf/include/common.h.
const (
	HookNone       Hook = iota
	HookConnect4        // cgroup/connect4
	HookConnect6        // cgroup/connect6
	HookSendmsg4        // cgroup/sendmsg4 (unconnected UDP)
	HookSendmsg6        // cgroup/sendmsg6
	HookSockops         // sockops, when a redirected socket connects
	HookSkLookup        // the pod netns' sk_lookup
	HookTCIngress       // tc ingress on the pod's interface (before Linux 5.17)
	HookReroute         // tc ingress on a virtual interface (R14)
	HookHostEgress      // tc egress on the node side of the pod's veth (H1, H2)
	hookCount
)

var hookNames = [hookCount]string{"none", "connect4", "connect6", "sendmsg4", "sendmsg6", "sockops", "sk_lookup", "tc_ingress", "reroute", "host_egress"}

func (h Hook) String() string {
	if h < hookCount {
		return hookNames[h]
	}
	return "unknown"
}

// MarshalText makes JSON show the name.
func (h Hook) MarshalText() ([]byte, error) { return []byte(h.String()), nil }

// UnmarshalText reads a name MarshalText wrote.
func (h *Hook) UnmarshalText(b []byte) error { return unmarshalName(b, hookNames[:], h) }

func unmarshalName[T ~uint8](b []byte, names []string, out *T) error {
	if i := slices.Index(names, string(b)); i >= 0 {
		*out = T(i)
		return nil
	}
	return fmt.Errorf("unknown name %q", b)
}

// Direction groups hooks by what they see: outbound (the socket hooks),
// inbound (sk_lookup, tc ingress), reroute, host.
func (h Hook) Direction() string {
	switch h {
	case HookConnect4, HookConnect6, HookSendmsg4, HookSendmsg6, HookSockops:
		return "outbound"
	case HookSkLookup, HookTCIngress:
		return "inbound"
	case HookReroute:
		return "reroute"
	case HookHostEgress:
		return "host"
	}
	return "none"
}
