// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// go.mod's istio.io/istio is the wrapper module's, which make
// istio-cni-bins builds from (the Makefile refuses a difference too).
func TestWrapperRequiresGoModsVersion(t *testing.T) {
	want, err := GoModVersion()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("../../hack/tools/istio-cni/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == Module && f[1] != want {
			t.Fatalf("hack/tools/istio-cni/go.mod requires %s %s but go.mod requires %s", Module, f[1], want)
		}
	}
	if !strings.Contains(string(b), "\t"+Module+" "+want) {
		t.Fatalf("hack/tools/istio-cni/go.mod does not require %s %s", Module, want)
	}
}

// A binary of another istio.io/istio is refused with both versions named.
func TestVersionSkewIsRefused(t *testing.T) {
	if err := CheckSkew("/bins/install-cni", "v1.2.3", "v1.2.3"); err != nil {
		t.Fatalf("same version refused: %v", err)
	}
	err := CheckSkew("/bins/install-cni", "v0.0.0-20260101000000-aaaaaaaaaaaa", "v0.0.0-20260827124520-eed52ebb66ad")
	if err == nil {
		t.Fatal("skew accepted")
	}
	for _, want := range []string{"/bins/install-cni", "v0.0.0-20260101000000-aaaaaaaaaaaa", "v0.0.0-20260827124520-eed52ebb66ad", "make istio-cni-bins"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
}

// A folder without both binaries is not taken, and one whose binaries are
// not of go.mod's istio.io/istio is refused, naming the binary.
func TestFindRefusesWhatIsNotTheBuild(t *testing.T) {
	const version = "v0.0.0-20260827124520-eed52ebb66ad"
	dir := t.TempDir()
	if _, err := find([]string{dir}, version); !errors.Is(err, ErrNoBinaries) || !strings.Contains(err.Error(), "make istio-cni-bins") {
		t.Fatalf("empty folder: %v", err)
	}
	// A test binary records no istio.io/istio: not a build of it.
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{AgentBinary, PluginBinary} {
		if err := os.WriteFile(filepath.Join(dir, name), self, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := find([]string{dir}, version); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, AgentBinary)) {
		t.Fatalf("not a build of %s: %v", Module, err)
	}
	// A script is no Go binary at all.
	if err := os.WriteFile(filepath.Join(dir, AgentBinary), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := find([]string{dir}, version); err == nil || !strings.Contains(err.Error(), AgentBinary) {
		t.Fatalf("not a Go binary: %v", err)
	}
}
