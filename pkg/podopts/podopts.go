// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package podopts is a pod's three mesh switches (contract rows R12-R14):
// package enrollment decides them from the pod's annotations, the data
// path applies them (packages dataplane and inspect encode them as map
// flags), package istiocni renders them as istio-cni's rules, and the
// reconciler and the takeover carry them between. One type for all, so a
// switch means the same everywhere. A leaf: it imports nothing of ours.
package podopts

import (
	"fmt"
	"slices"
)

// Options are the per-pod switches.
type Options struct {
	// BypassInbound leaves inbound traffic alone (R12, ingress mode:
	// ambient.istio.io/bypass-inbound-capture).
	BypassInbound bool `json:"bypassInbound,omitempty"`
	// DNSCapture sends DNS to ztunnel's proxy (R9, R13): the node's
	// default, or ambient.istio.io/dns-capture.
	DNSCapture bool `json:"dnsCapture,omitempty"`
	// RerouteInterfaces are virtual interfaces whose TCP is treated as
	// the pod's outbound traffic (R14: istio.io/reroute-virtual-interfaces),
	// in the annotation's order.
	RerouteInterfaces []string `json:"rerouteInterfaces,omitempty"`
}

// Equal compares two option sets, reroute interfaces in order.
func (o Options) Equal(p Options) bool {
	return o.BypassInbound == p.BypassInbound && o.DNSCapture == p.DNSCapture && slices.Equal(o.RerouteInterfaces, p.RerouteInterfaces)
}

// Clone returns o with a reroute list of its own.
func (o Options) Clone() Options {
	o.RerouteInterfaces = slices.Clone(o.RerouteInterfaces)
	return o
}

func (o Options) String() string {
	return fmt.Sprintf("dns=%t bypassInbound=%t reroute=%v", o.DNSCapture, o.BypassInbound, o.RerouteInterfaces)
}
