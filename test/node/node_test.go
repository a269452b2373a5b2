// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// repoRoot is the module root, seen from this package's directory.
const repoRoot = "../.."

var (
	images    *Archives
	imagesErr error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "hn-images-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	start := time.Now()
	images, imagesErr = BuildImages(repoRoot, dir)
	fmt.Fprintf(os.Stderr, "node: images built in %s\n", time.Since(start).Round(time.Millisecond))
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func cniPlugins(t *testing.T) string {
	d := os.Getenv("CNI_PLUGINS_DIR")
	if d == "" {
		d = filepath.Join(repoRoot, ".cache", "cni-plugins", "v1.10.0")
	}
	return d
}

func TestSmoke(t *testing.T) {
	if imagesErr != nil {
		t.Fatal(imagesErr)
	}
	n := New(t, Config{CNIPlugins: cniPlugins(t), Images: images.All()})
	p := n.MustRunPod(PodSpec{Name: "a", Namespace: "default", UID: "0000-a"})
	t.Logf("pod ip %s netns %s", p.IP, n.NetnsPath(p))
	n.MustStartContainer(p, AppContainer("echo", EchoImage, "serve", "a", ":8080", ":8081"))
	q := n.MustRunPod(PodSpec{Name: "b", Namespace: "default", UID: "0000-b"})
	n.MustStartContainer(q, AppContainer("client", ClientImage, "pause"))
	var r struct {
		Reply any
		Err   string
	}
	n.Exec(q, "client", &r, AppBinary, "dial", p.IP.String()+":8080")
	t.Logf("%+v", r)
	time.Sleep(time.Second)
	t.Log(n.Log(p, "echo"))
}
