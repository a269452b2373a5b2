// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package upgrade brings pins of another layout to this build's: the
// layout record (<bpffs>/ae_layout: the pins' layout, the oldest layout
// that may take them over, the build that wrote them) and the upgrade of
// the pinned maps, to an older layout too (a downgrade is an upgrade the
// other way). Taking a node's redirection over from istio-cni is package
// takeover's.
//
// The runtime (package dataplane's New) hands it what it needs and loads
// nothing through it: Check refuses pins this build cannot take over
// before anything is created; Prepare, given the collection specs the
// runtime will load, fills a new map under next/ for each map whose key or
// value changed (entries converted field by field by the maps' BTF) and
// returns the Plan whose Replacements the runtime loads with; the runtime
// switches its links in place; Finish moves the new maps over the old pins,
// removes what this build lacks and marks the record stable. An agent
// killed at any of Steps leaves a record the next one, of either layout,
// finishes from.
//
// layout.go names this build's layout and the fingerprints of shipped
// ones (TestLayoutFingerprint); build tag ae_layout_next swaps in the
// tests' next layout. ReadLayout reads the record without an agent.
package upgrade
