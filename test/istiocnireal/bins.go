// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"debug/buildinfo"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
)

// Module is the Go module both binaries come from.
const Module = "istio.io/istio"

// BinsEnv names the environment variable that points at the folder holding
// install-cni and istio-cni (the Makefile exports it).
const BinsEnv = "AMBIENT_EBPF_ISTIO_CNI_BINS"

// The binaries, by file name: the node agent and the chained plugin.
const (
	AgentBinary  = "install-cni"
	PluginBinary = "istio-cni"
)

// ErrNoBinaries is returned by FindBinaries when install-cni or istio-cni
// is not built.
var ErrNoBinaries = errors.New("the real istio-cni is not built: run make istio-cni-bins")

// Bins is the folder of a built install-cni and istio-cni and the version
// of istio.io/istio they were built from.
type Bins struct {
	Dir     string
	Version string
}

// Agent and Plugin are the binaries' paths.
func (b Bins) Agent() string  { return filepath.Join(b.Dir, AgentBinary) }
func (b Bins) Plugin() string { return filepath.Join(b.Dir, PluginBinary) }

// GoModVersion is the version of istio.io/istio that go.mod requires (the
// source tree's above the working directory): whose types (zdsapi) the
// agent and the tests speak.
func GoModVersion() (string, error) {
	root, err := sourceRoot()
	if err != nil {
		return "", err
	}
	path := filepath.Join(root, "go.mod")
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read %s: %w", path, err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "require "))
		if len(f) >= 2 && f[0] == Module {
			return f[1], nil
		}
	}
	return "", fmt.Errorf("%s requires no %s", path, Module)
}

// sourceRoot is the source tree above the working directory.
func sourceRoot() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	return testbin.Root(wd)
}

// BinaryVersion is the version of istio.io/istio the Go binary at path was
// built from, as its build information records it.
func BinaryVersion(path string) (string, error) {
	info, err := buildinfo.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read build information of %s: %w", path, err)
	}
	if info.Main.Path == Module {
		return info.Main.Version, nil
	}
	for _, d := range info.Deps {
		if d.Path == Module {
			return d.Version, nil
		}
	}
	return "", fmt.Errorf("%s is not built from %s", path, Module)
}

// CheckSkew refuses a binary built from another istio.io/istio than
// go.mod's, naming both.
func CheckSkew(path, built, goMod string) error {
	if built != goMod {
		return fmt.Errorf("version skew: %s is built from %s %s but go.mod requires %s %s; run make istio-cni-bins",
			path, Module, built, Module, goMod)
	}
	return nil
}

// FindBinaries returns the folder of install-cni and istio-cni for
// go.mod's version: $AMBIENT_EBPF_ISTIO_CNI_BINS, or .cache/istio-cni/<version>
// in the working directory or one above it. It refuses binaries of another
// version (CheckSkew).
func FindBinaries() (Bins, error) {
	version, err := GoModVersion()
	if err != nil {
		return Bins{}, err
	}
	var candidates []string
	if d := os.Getenv(BinsEnv); d != "" {
		candidates = append(candidates, d)
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			candidates = append(candidates, filepath.Join(d, ".cache", "istio-cni", version))
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	return find(candidates, version)
}

// find returns the first candidate folder holding both binaries, refusing
// them when they are of another version than version.
func find(candidates []string, version string) (Bins, error) {
	for _, d := range candidates {
		b := Bins{Dir: d, Version: version}
		if !isExecutable(b.Agent()) || !isExecutable(b.Plugin()) {
			continue
		}
		for _, path := range []string{b.Agent(), b.Plugin()} {
			built, err := BinaryVersion(path)
			if err != nil {
				return Bins{}, err
			}
			if err := CheckSkew(path, built, version); err != nil {
				return Bins{}, err
			}
		}
		return b, nil
	}
	return Bins{}, fmt.Errorf("%w (looked for %s and %s of %s %s in %v)", ErrNoBinaries, AgentBinary, PluginBinary, Module, version, candidates)
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// Require returns the binaries or fails the test, in CI and outside it:
// a suite that claims to compare with the real istio-cni never skips.
func Require(tb testing.TB) Bins {
	tb.Helper()
	b, err := FindBinaries()
	if err != nil {
		tb.Fatal(err)
	}
	return b
}
