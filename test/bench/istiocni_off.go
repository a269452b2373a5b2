// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench && !istiocnireal

package bench

import (
	"errors"
	"testing"
	"time"

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

func (*istioCNI) batch(string, int, bool) []*simnode.Pod { return nil }

// istioScale is the real istio-cni's scale run (istiocni.go).
type istioScale struct {
	add                      cniResult
	remove                   time.Duration
	addCPU, delCPU           time.Duration
	before, at               int64
	hwm                      int64
	adopt, adoptCPU, ready   time.Duration
	addProfile, adoptProfile string
	mountsBefore, mounts     int
}

func (*istioCNI) scale(int, int) (istioScale, error) {
	return istioScale{}, errors.New(istioCNINotBuilt)
}

func (*istioCNI) cni(string, []*simnode.Pod, int) (cniResult, error) {
	return cniResult{}, errors.New(istioCNINotBuilt)
}

func (*istioCNI) version() string { return "" }
