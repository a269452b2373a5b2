// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube/kubetest"
	"k8s.io/apimachinery/pkg/types"
)

const podFile = `apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/dataplane-mode: NSMODE}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: demo, uid: web-uid}
spec: {nodeName: node-1, containers: [{name: app, image: app}]}
status: {phase: Running, podIP: 10.0.0.5}
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: demo, uid: other-uid}
spec: {nodeName: node-2, containers: [{name: app, image: app}]}
status: {phase: Running, podIP: 10.0.0.6}
`

// writeAtomically replaces path by a rename, as editors and ConfigMap
// volumes do.
func writeAtomically(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting: %s", what)
		}
	}
}

// serve runs src as the agent does: Start, then between (the agent's
// snapshot step, when set), then Run in the background. stop ends Run and
// checks its error.
func serve(t *testing.T, src kube.Source, between func()) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if err := src.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	if between != nil {
		between()
	}
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}
	t.Cleanup(stop)
	return stop
}

// testConfig is the controller configuration of these tests: node-1, the
// default enrollment, no log.
func testConfig() kube.Config {
	return kube.Config{NodeName: "node-1", Enrollment: enrollment.DefaultConfig(), Logger: slog.New(slog.DiscardHandler)}
}

// serveFile writes content as a pod file at path and serves a FileSource
// over it with a fake Mesh.
func serveFile(t *testing.T, content string) (src *kube.FileSource, mesh *kubetest.Mesh, path string, stop func()) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "pods.yaml")
	writeAtomically(t, path, content)
	mesh = kubetest.NewMesh()
	src, err := kube.NewFileSource(testConfig(), path, mesh)
	if err != nil {
		t.Fatal(err)
	}
	return src, mesh, path, serve(t, src, nil)
}

func TestFileSourceEnrollsAndRemovesPodsAsTheFileChanges(t *testing.T) {
	src, mesh, path, stop := serveFile(t, strings.ReplaceAll(podFile, "NSMODE", "ambient"))

	web := types.UID("web-uid")
	waitFor(t, "web enrolled from the file", func() bool { return mesh.Redirection(web) == kube.RedirectionEnabled })
	waitFor(t, "redirection published", func() bool { return src.Redirection(web) == kube.RedirectionEnabled })

	writeAtomically(t, path, "apiVersion: v1\nkind: Pod\nmetadata: {name: [broken")
	time.Sleep(200 * time.Millisecond)
	if mesh.Redirection(web) != kube.RedirectionEnabled {
		t.Fatal("a file that fails to parse dropped the pod from the mesh")
	}

	writeAtomically(t, path, strings.ReplaceAll(podFile, "NSMODE", "none"))
	waitFor(t, "web removed when the namespace label goes", func() bool { return mesh.Redirection(web) == kube.RedirectionNone })
	waitFor(t, "redirection withdrawn", func() bool { return src.Redirection(web) == kube.RedirectionNone })

	if calls := mesh.CallsFor("other-uid"); len(calls) != 0 {
		t.Errorf("pod of another node got mesh calls %+v", calls)
	}
	stop()
}

func TestFileSourceRefusesRepairModesThatNeedTheAPI(t *testing.T) {
	cfg := kube.Config{NodeName: "node-1", Repair: kube.RepairConfig{Mode: kube.RepairDelete}}
	if _, err := kube.NewFileSource(cfg, "pods.yaml", kubetest.NewMesh()); err == nil {
		t.Error("NewFileSource accepted repair mode delete")
	}
}
