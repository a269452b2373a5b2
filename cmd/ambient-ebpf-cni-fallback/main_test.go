// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo/buildinfotest"
)

func TestMain(m *testing.M) { buildinfotest.Main(m, main) }

// --version prints the name and the build information and does nothing else.
func TestVersionFlag(t *testing.T) { buildinfotest.VersionFlag(t, "ambient-ebpf-cni-fallback") }
