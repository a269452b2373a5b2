// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build !istiocnireal

package conformance

// realBackends: without the istiocnireal tag (the kernel suites under
// qemu, go test by hand) the real istio-cni is not among the backends.
func realBackends() []backend { return nil }
