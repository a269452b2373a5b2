// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench && !istiocnireal

package bench

import (
	"errors"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// istioCNI is the real istio-cni's column, built with the istiocnireal
// tag (istiocni.go; make bench builds with it). Without the tag there is
// no column: the run says so in its notes, and CI=true fails it.
type istioCNI struct{}

func startIstioCNI(t *testing.T) *istioCNI {
	t.Helper()
	if testenv.InCI() {
		t.Fatal("CI=true: " + istioCNINotBuilt)
	}
	return nil
}

func (*istioCNI) batch(string, int) []*simnode.Pod { return nil }

func (*istioCNI) cni(string, []*simnode.Pod, int) (cniResult, error) {
	return cniResult{}, errors.New(istioCNINotBuilt)
}

func (*istioCNI) version() string { return "" }
