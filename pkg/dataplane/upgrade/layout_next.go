// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build ae_layout_next

package upgrade

// The test-only next layout (build tag ae_layout_next; bpfobj's gen.go
// builds its objects with AE_LAYOUT_NEXT): a field more in ae_pods'
// value. Agents of the shipped layout take it over, so it is compatible
// with them.
const (
	layoutVersion = 2
	layoutCompat  = 1
)

func layoutFingerprints() map[int]string { return map[int]string{} }
