// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standalone_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler/reconcilertest"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/standalone"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
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

var serve = reconcilertest.Serve

var discard = slog.New(slog.DiscardHandler)

// serveFile writes content as a pod file at path and serves a Source for
// node-1 over it, reporting to the reconciler over fakes, whose Changes
// the Source listens to as the agent wires it.
func serveFile(t *testing.T, content string) (src *standalone.Source, mesh *reconcilertest.Mesh, path string, stop func()) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "pods.yaml")
	writeAtomically(t, path, content)
	mesh = reconcilertest.NewMesh()
	src, err := standalone.NewSource("node-1", path, discard)
	if err != nil {
		t.Fatal(err)
	}
	rec := mesh.Start(t, reconciler.Config{RepairInPlace: true, Logger: discard})
	rec.Subscribe(src.Observe)
	return src, mesh, path, serve(t, src, mesh, nil)
}

func TestFileSourceEnrollsAndRemovesPodsAsTheFileChanges(t *testing.T) {
	src, mesh, path, stop := serveFile(t, strings.ReplaceAll(podFile, "NSMODE", "ambient"))

	web := types.UID("web-uid")
	testenv.Eventually(t, 10*time.Second, "web enrolled from the file", func() bool { return mesh.Redirection(web) == enrollment.RedirectionEnabled })
	testenv.Eventually(t, 10*time.Second, "redirection published", func() bool { return src.Redirection(web) == enrollment.RedirectionEnabled })

	writeAtomically(t, path, "apiVersion: v1\nkind: Pod\nmetadata: {name: [broken")
	time.Sleep(200 * time.Millisecond)
	if mesh.Redirection(web) != enrollment.RedirectionEnabled {
		t.Fatal("a file that fails to parse dropped the pod from the mesh")
	}

	writeAtomically(t, path, strings.ReplaceAll(podFile, "NSMODE", "none"))
	testenv.Eventually(t, 10*time.Second, "web removed when the namespace label goes", func() bool { return mesh.Redirection(web) == enrollment.RedirectionNone })
	testenv.Eventually(t, 10*time.Second, "redirection withdrawn", func() bool { return src.Redirection(web) == enrollment.RedirectionNone })

	if calls := mesh.CallsFor("other-uid"); len(calls) != 0 {
		t.Errorf("pod of another node got mesh calls %+v", calls)
	}
	stop()
}

// A pod file entry without a uid is enrolled under the derived standalone
// uid, one path element; a file with the pod named shop/../../links, whose
// pins once went into links/, is refused as a whole.
func TestFileSourceGivesUIDlessPodsASafeStandaloneUID(t *testing.T) {
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: NAME, namespace: shop, labels: {istio.io/dataplane-mode: ambient}}\n" +
		"spec: {nodeName: node-1, containers: [{name: app, image: app}]}\nstatus: {phase: Running, podIP: 198.18.0.5}\n"
	_, mesh, _, stop := serveFile(t, strings.ReplaceAll(pod, "NAME", "web"))
	uid := types.UID(validate.StandaloneUID("shop", "web"))
	testenv.Eventually(t, 10*time.Second, "web enrolled under its standalone uid", func() bool { return mesh.Redirection(uid) == enrollment.RedirectionEnabled })
	stop()
	for _, call := range mesh.Calls() {
		if err := validate.PodUID(string(call.UID)); err != nil || call.UID != uid {
			t.Errorf("mesh call %+v: %v", call, err)
		}
	}

	bad := filepath.Join(t.TempDir(), "pods.yaml")
	if err := os.WriteFile(bad, []byte(strings.ReplaceAll(pod, "NAME", "../../links")), 0o600); err != nil {
		t.Fatal(err)
	}
	src, err := standalone.NewSource("node-1", bad, discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Start(context.Background()); !errors.Is(err, validate.ErrInvalid) || !strings.Contains(err.Error(), `"../../links"`) {
		t.Errorf("Start with a traversal pod name = %v; want an invalid identity naming it", err)
	}
}
