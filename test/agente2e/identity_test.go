// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
)

// pinDirs lists the entries of a bpffs subdirectory.
func pinDirs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

// The real agent: a pod of the file without a uid is pinned under its
// standalone uid, one directory under pods/; an ADD with a traversal uid is
// refused and touches no pin; DELs without K8S_POD_UID find the pods by
// container id and by name.
func TestAgentPinsUnderSafeUIDsAndDelsWithoutUID(t *testing.T) {
	n := newAgentNode(t, "app")
	app := n.pods["app"]
	bare := n.AddPod("bare")
	file := podFile(app) + "---\napiVersion: v1\nkind: Pod\nmetadata: {name: bare, namespace: default}\nspec: {nodeName: node-1}\n"
	if err := os.WriteFile(n.PodFile, []byte(file), 0o644); err != nil {
		t.Fatal(err)
	}
	n.StartReadyAgent(t, "--uninstall-on-exit")
	n.StartZtunnelFor(n.ZDS)
	links := filepath.Join(n.BPFFSDir, "links")
	linksBefore := pinDirs(t, links)

	traversal := *app
	traversal.UID = "../../links"
	if _, err := n.podAdd(t, &traversal); err == nil || !strings.Contains(err.Error(), "invalid pod uid") {
		t.Errorf("ADD with uid ../../links = %v; want it refused", err)
	}
	testenv.Eventually(t, time.Minute, "ztunnel connected", func() bool {
		_, body := n.Get("/metrics")
		return strings.Contains(body, "ztunnel_connected 1")
	})
	if _, err := n.podAdd(t, app); err != nil {
		t.Fatalf("ADD app: %v; agent:\n%s", err, n.Agent.Output.String())
	}
	bareNoUID := *bare
	bareNoUID.UID = ""
	if _, err := n.podAdd(t, &bareNoUID); err != nil {
		t.Fatalf("ADD bare: %v; agent:\n%s", err, n.Agent.Output.String())
	}
	want := []string{app.UID, validate.StandaloneUID("default", "bare")}
	slices.Sort(want)
	if got := pinDirs(t, filepath.Join(n.BPFFSDir, "pods")); !slices.Equal(got, want) {
		t.Errorf("pods/ holds %v; want %v", got, want)
	}
	if got := pinDirs(t, links); !slices.Equal(got, linksBefore) {
		t.Errorf("links/ changed: %v -> %v", linksBefore, got)
	}

	n.del(t, &cniv1.Pod{ContainerId: "sandbox-app", Netns: "/var/run/netns/gone"})
	n.del(t, &cniv1.Pod{Namespace: "default", Name: "bare", ContainerId: "sandbox-bare"})
	if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != 0 {
		t.Errorf("pinned pods after DELs without uid = %+v", got)
	}
	if got := pinDirs(t, links); !slices.Equal(got, linksBefore) {
		t.Errorf("links/ changed by the DELs: %v -> %v", linksBefore, got)
	}
}
