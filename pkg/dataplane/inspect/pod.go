// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"net/netip"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// EnrolledPod is a pod as the pinned maps describe it.
type EnrolledPod struct {
	UID           string          `json:"uid"`
	Namespace     string          `json:"namespace"`
	Name          string          `json:"name"`
	Interface     string          `json:"interface"`
	HostInterface string          `json:"hostInterface"`
	NetnsCookie   uint64          `json:"netnsCookie"`
	IPs           []netip.Addr    `json:"ips"`
	Options       podopts.Options `json:"options"`
	Slot          uint32          `json:"slot"`
	// Problem is what of the pod's capture its map entries do not give
	// it (an address whose ae_pods entry is missing or another pod's:
	// its inbound traffic reaches the app past ztunnel); "" when they
	// all do. Such a pod is inconsistent, not enrolled.
	Problem string `json:"problem,omitempty"`
}

// Stats are a pod's counters, summed over CPUs.
type Stats struct {
	OutboundRedirects uint64 `json:"outboundRedirects"`
	InboundRedirects  uint64 `json:"inboundRedirects"`
	InboundNoListener uint64 `json:"inboundNoListener"`
	OrigDstErrors     uint64 `json:"origDstErrors"`
	DNSRedirects      uint64 `json:"dnsRedirects"`
	RerouteRedirects  uint64 `json:"rerouteRedirects"`
	ProbeSNAT         uint64 `json:"probeSnat"`
	ProbeNATFull      uint64 `json:"probeNatFull"`
}

// OptionFlags encodes the options as ae_pods and ae_netns flags (AE_F_*).
func OptionFlags(o podopts.Options) uint32 {
	var f uint32
	if o.BypassInbound {
		f |= bpfobj.FlagBypassInbound
	}
	if o.DNSCapture {
		f |= bpfobj.FlagDNSCapture
	}
	return f
}

// OptionsFromFlags decodes OptionFlags; the reroute interfaces are not in
// the maps (a pod's pins name them).
func OptionsFromFlags(f uint32) podopts.Options {
	return podopts.Options{BypassInbound: f&bpfobj.FlagBypassInbound != 0, DNSCapture: f&bpfobj.FlagDNSCapture != 0}
}
