// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package soak runs the chaos soak: the real agent binary on a simulated
// node against the real kube-apiserver, with the ztunnel stand-in, pods
// added and deleted through the real CNI plugin, and faults drawn from a
// seed, together, while a sampler checks every connection. `make test`
// runs a short soak (SOAK_DURATION, default 100 s); `make soak` a long one.
// A failing run prints its seed: SOAK_SEED=<seed> replays its schedule.
package soak

import (
	"context"
	"flag"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/cilium/ebpf/rlimit"

	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The API server is the soak's own: it restarts it.
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
	flag.Parse()
	if testing.Short() {
		clusterErr = kubeapi.ErrShort
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		cluster, clusterErr = kubeapi.Start(ctx)
		cancel()
	}
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}
