//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package differential drives the same scenarios through the real
// istio-cni (Istio's install-cni and istio-cni plugin, test/istiocnireal)
// and through ambient-ebpf (the real agent, test/agentrun), each on a fresh
// simulated node against one real kube-apiserver, and compares what users
// and ztunnel observe. Its files build with the istiocnireal tag only:
// `make test-istio-cni` runs them after building the binaries; nothing
// here skips (a missing binary fails with the make target to run).
package differential

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

var (
	cluster    *kubeapi.Cluster
	clusterErr error
)

func TestMain(m *testing.M) {
	simnode.RunHelper()
	if err := rlimit.RemoveMemlock(); err != nil {
		fmt.Fprintln(os.Stderr, "remove memlock limit:", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	cluster, clusterErr = kubeapi.Start(ctx)
	cancel()
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

// requireCluster returns the API server or fails: never a skip here.
func requireCluster(t *testing.T) *kubeapi.Cluster {
	t.Helper()
	if clusterErr != nil {
		t.Fatalf("kube-apiserver (make kube-bins): %v", clusterErr)
	}
	return cluster
}
