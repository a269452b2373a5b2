// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build !ae_layout_next

package upgrade

// The pinned layout of this build: what maps (names, types, keys, values),
// programs and links it keeps under the bpffs directory. Bump
// layoutVersion with every change to one of them (TestLayoutFingerprint
// fails until layoutFingerprints names the new layout), and layoutCompat
// when an agent of an older layout can no longer take the new one over by
// the generic conversion (fields matched by name, see convert_linux.go).
const (
	layoutVersion = 1
	layoutCompat  = 1
)

// layoutFingerprints are the fingerprints of the shipped layouts.
func layoutFingerprints() map[int]string {
	return map[int]string{
		1: "89ba73d3f94938c3", // v0.1.0
	}
}
