// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package testbin builds the binaries the end-to-end tests run: this
// tree's commands, stamped with the version the Makefile stamps
// (hack/version.sh), optionally with build tags; and the commands of a
// release (hack/releases), built at the release's commit in a scratch git
// worktree and cached by commit under .cache/releases/<commit>/.
//
// Where no Go toolchain or git is at hand (the kernel suites under qemu,
// hack/vmtest), PrebuiltEnv names a directory Prebuild filled beforehand
// and every build is taken from there instead.
package testbin

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
)

// PrebuiltEnv names a directory of binaries built by Prebuild.
const PrebuiltEnv = "AMBIENT_EBPF_TEST_BINS"

// SymbolsEnv set to 1 keeps the symbol table and DWARF in what Head
// builds (by default stripped, -s -w, as the image's binaries are), so
// that perf can name the functions of a profile (the benchmark sets it).
// Releases' builds, cached by commit, are always stripped.
// The stripped sections are not loaded: an exec costs the same.
const SymbolsEnv = "AMBIENT_EBPF_TEST_SYMBOLS"

// Release is one line of hack/releases.
type Release struct {
	Version string // "v0.1.0"
	Commit  string // the full commit hash
}

// Releases reads hack/releases of the tree at root, oldest first (with
// PrebuiltEnv set, the copy Prebuild left there).
func Releases(root string) ([]Release, error) {
	path := filepath.Join(root, "hack", "releases")
	if pre := os.Getenv(PrebuiltEnv); pre != "" {
		path = filepath.Join(pre, "releases.txt")
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("read releases: %w", err)
	}
	defer f.Close()
	var out []Release
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 || len(fields[1]) != 40 {
			return nil, fmt.Errorf("hack/releases: %q is not \"VERSION COMMIT\" with a full commit hash", line)
		}
		out = append(out, Release{Version: fields[0], Commit: fields[1]})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read releases: %w", err)
	}
	if len(out) == 0 {
		return nil, errors.New("hack/releases lists no release")
	}
	return out, nil
}

// Root returns the root of this module's source tree, found from dir
// upwards (tests run in their package's directory).
func Root(dir string) (string, error) {
	for d := dir; ; d = filepath.Dir(d) {
		if _, err := os.Stat(filepath.Join(d, "hack", "releases")); err == nil {
			return d, nil
		}
		if filepath.Dir(d) == d {
			return "", fmt.Errorf("no source tree (hack/releases) above %s", dir)
		}
	}
}

// Name is the file name of pkg's binary built with tags.
func Name(pkg string, tags ...string) string {
	name := filepath.Base(pkg)
	for _, t := range tags {
		name += "." + t
	}
	return name
}

// Head builds pkg (an import path of this module) of the tree at root
// with tags into dir, stamped as `make build` stamps, and returns its
// path; with PrebuiltEnv set it returns the prebuilt one.
func Head(root, dir, pkg string, tags ...string) (string, error) {
	name := Name(pkg, tags...)
	if pre := os.Getenv(PrebuiltEnv); pre != "" {
		return prebuilt(filepath.Join(pre, name))
	}
	version, err := stampVersion(root)
	if err != nil {
		return "", err
	}
	rev, _ := git(root, "rev-parse", "HEAD")
	out := filepath.Join(dir, name)
	ldflags := buildinfo.LDFlags(version, rev)
	if os.Getenv(SymbolsEnv) != "1" {
		ldflags = "-s -w " + ldflags
	}
	if err := goBuild(root, out, pkg, ldflags, tags); err != nil {
		return "", err
	}
	return out, nil
}

// Build returns the path of pkg's binary of release r, built once per
// commit into root's .cache/releases/<commit>/ (at the commit, in a
// scratch worktree removed afterwards, stamped with the release's
// version); with PrebuiltEnv set it returns the prebuilt one.
func Build(root string, r Release, pkg string) (string, error) {
	if pre := os.Getenv(PrebuiltEnv); pre != "" {
		return prebuilt(filepath.Join(pre, "releases", r.Commit, filepath.Base(pkg)))
	}
	cache := filepath.Join(root, ".cache", "releases", r.Commit)
	out := filepath.Join(cache, filepath.Base(pkg))
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", fmt.Errorf("release cache: %w", err)
	}
	scratch, err := os.MkdirTemp("", "ambient-ebpf-release-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(scratch)
	tree := filepath.Join(scratch, "tree")
	if _, err := git(root, "worktree", "add", "--detach", tree, r.Commit); err != nil {
		return "", fmt.Errorf("check out release %s (%s): %w", r.Version, r.Commit, err)
	}
	defer func() { _, _ = git(root, "worktree", "remove", "--force", tree) }()
	// Written under a temporary name and renamed: a concurrent or
	// interrupted build never leaves a partial binary in the cache.
	tmp := filepath.Join(cache, "."+filepath.Base(pkg)+".tmp."+filepath.Base(scratch))
	if err := goBuild(tree, tmp, pkg, "-s -w "+buildinfo.LDFlags(r.Version, r.Commit), nil); err != nil {
		return "", fmt.Errorf("build release %s: %w", r.Version, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", fmt.Errorf("release cache: %w", err)
	}
	return out, nil
}

func prebuilt(path string) (string, error) {
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("prebuilt binary (%s): %w", PrebuiltEnv, err)
	}
	return path, nil
}

// stampVersion is hack/version.sh's answer for the tree at root.
func stampVersion(root string) (string, error) {
	cmd := exec.Command(filepath.Join(root, "hack", "version.sh"))
	cmd.Dir = root
	b, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/version.sh: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// goBuild builds a static, stripped binary (it also runs in the VMs'
// initramfs, which holds it in memory).
func goBuild(dir, out, pkg, ldflags string, tags []string) error {
	args := []string{"build", "-trimpath", "-ldflags", ldflags, "-o", out}
	if len(tags) > 0 {
		args = append(args, "-tags", strings.Join(tags, ","))
	}
	cmd := exec.Command("go", append(args, pkg)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %w: %s", pkg, err, b)
	}
	return nil
}

func git(dir string, args ...string) (string, error) {
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	b, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, b)
	}
	return strings.TrimSpace(string(b)), nil
}

// Last is the newest release of hack/releases.
func Last(root string) (Release, error) {
	rs, err := Releases(root)
	if err != nil {
		return Release{}, err
	}
	return rs[len(rs)-1], nil
}

// Prebuild builds into dir what the tests ask for where they cannot build
// (PrebuiltEnv): each pkg of the tree at root with each set of tags, and
// each pkg of the last release, with a copy of hack/releases.
func Prebuild(root, dir string, pkgs []string, tagSets [][]string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, pkg := range pkgs {
		for _, tags := range tagSets {
			if _, err := Head(root, dir, pkg, tags...); err != nil {
				return err
			}
		}
	}
	last, err := Last(root)
	if err != nil {
		return err
	}
	for _, pkg := range pkgs {
		bin, err := Build(root, last, pkg)
		if err != nil {
			return err
		}
		out := filepath.Join(dir, "releases", last.Commit, filepath.Base(pkg))
		if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
			return err
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			return err
		}
		if err := os.WriteFile(out, b, 0o755); err != nil {
			return err
		}
	}
	b, err := os.ReadFile(filepath.Join(root, "hack", "releases"))
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "releases.txt"), b, 0o644)
}
