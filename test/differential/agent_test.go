//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The binaries under test are those of go.mod's istio.io/istio: a build of
// another version is refused, naming both.
func TestRealBinariesAreGoModsVersion(t *testing.T) {
	b := istiocnireal.Require(t)
	for _, path := range []string{b.Agent(), b.Plugin()} {
		built, err := istiocnireal.BinaryVersion(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := istiocnireal.CheckSkew(path, built, b.Version); err != nil {
			t.Fatal(err)
		}
	}
}

// install-cni as its DaemonSet runs it on a node: it chains its plugin
// into the primary conflist, copies the plugin, becomes ready (with the
// node netns as its host's), and takes
// the ztunnel stand-in's ZDS connection (an empty snapshot: SnapshotSent
// alone). Stopped, it takes its plugin out again (no DaemonSet: uninstall).
func TestInstallCNIBecomesReadyAndServesZtunnel(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	bins := istiocnireal.Require(t)
	n := simnode.New(t)
	r := istiocnireal.NewRuntime(t, n, "", "", istiocnireal.PluginsDir(t))
	a := istiocnireal.Start(t, r, bins, istiocnireal.Options{Cluster: c, NodeName: "node-" + n.ID})
	took, err := a.WaitReady()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("install-cni ready %s after its exec", took.Round(time.Millisecond))
	// Its host netns, as it finds it (/host/proc/1/ns/net), is the node's.
	if pid := a.PID(); pid == 0 || nstest.IdentOfPath(t, fmt.Sprintf("/proc/%d/root/host/proc/1/ns/net", pid)) != nstest.IdentOfPath(t, simnode.NetnsPath(n.NodeNS)) {
		t.Fatalf("install-cni (pid %d) does not see the node netns as its host's", pid)
	}
	chain, err := r.Chain()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(chain, []string{"ptp", "istio-cni"}) {
		t.Fatalf("conflist chain %v, want ptp then istio-cni", chain)
	}
	if _, err := os.Stat(r.BinDir + "/istio-cni"); err != nil {
		t.Fatalf("plugin not installed: %v", err)
	}
	zt := n.StartZtunnelFor(a.ZDS)
	if err := a.WaitZtunnel(); err != nil {
		t.Fatal(err)
	}
	var got []string
	testenv.Poll(10*time.Second, func() bool {
		tr, err := zt.Transcript()
		got = nil
		for _, o := range tr {
			got = append(got, o.Kind)
		}
		return err == nil && len(got) > 0
	})
	if !slices.Equal(got, []string{"snapshot_sent"}) {
		t.Fatalf("ztunnel received %v, want [snapshot_sent]", got)
	}
	if err := a.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	if chain, err := r.Chain(); err != nil || !slices.Equal(chain, []string{"ptp"}) {
		t.Fatalf("after stop, conflist chain %v (%v), want ptp alone", chain, err)
	}
}

// An install-cni that cannot start (an enablement selector it refuses)
// is reported with its output, and nothing of its run is left: no
// process, and no mount of the runtime's netns folder (the mounts of its
// own view went with its mount namespace).
func TestInstallCNIThatExitsIsReportedAndCleanedUp(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	bins := istiocnireal.Require(t)
	var dir string
	var pid int
	t.Run("run", func(t *testing.T) {
		n := simnode.New(t)
		r := istiocnireal.NewRuntime(t, n, "", "", istiocnireal.PluginsDir(t))
		a := istiocnireal.Start(t, r, bins, istiocnireal.Options{Cluster: c, NodeName: "node-" + n.ID,
			Env: map[string]string{"AMBIENT_ENABLEMENT_SELECTOR": "- podSelector: ["}})
		dir, pid = r.NetnsDir, a.Process.PID()
		_, err := a.WaitReady()
		if err == nil || !strings.Contains(err.Error(), "failed to parse ambient enablement selector") {
			t.Fatalf("WaitReady: %v", err)
		}
	})
	mounts, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mounts), dir) {
		t.Errorf("a mount of %s is left", dir)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
		t.Errorf("process %d (unshare of install-cni) is left", pid)
	}
}
