// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package buildinfo reports a binary's version: the one the build stamped
// with -ldflags (LDFlags: `make build`, the Dockerfile, the tests' builds,
// all from hack/version.sh), else what the Go toolchain stamped
// (runtime/debug.ReadBuildInfo: the module version, the VCS revision and
// whether the tree had local changes). A plain `go build` in a linked git
// worktree, or of a tree without .git, gets no VCS stamp from Go and
// reports "(devel)" unless -ldflags gave the version.
package buildinfo

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"
)

// Info is one binary's build information.
type Info struct {
	// Version is the main module's version: a release tag, a
	// pseudo-version (v0.0.0-<time>-<revision>, +dirty when modified) or
	// "(devel)".
	Version string `json:"version"`
	// Revision is the VCS commit (vcs.revision), "" when not stamped.
	Revision string `json:"revision"`
	// Time is the commit time (vcs.time, RFC 3339), "" when not stamped.
	Time string `json:"time"`
	// Modified reports uncommitted changes in the tree (vcs.modified).
	Modified bool `json:"modified"`
	// GoVersion is the toolchain that built the binary.
	GoVersion string `json:"goVersion"`
	// Platform is the OS and architecture it was built for (linux/amd64,
	// linux/arm64).
	Platform string `json:"platform"`
}

// Set by the linker only (LDFlags), never at run time.
var (
	stampedVersion  string
	stampedRevision string
)

// LDFlags is the -ldflags value that stamps version and revision (either
// may be empty) into a binary of this module.
func LDFlags(version, revision string) string {
	const pkg = "github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	return fmt.Sprintf("-X %s.stampedVersion=%s -X %s.stampedRevision=%s", pkg, version, pkg, revision)
}

// Read returns the running binary's build information.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	info := Info{Version: "unknown"}
	if ok {
		info = FromBuildInfo(bi)
	}
	info.Platform = runtime.GOOS + "/" + runtime.GOARCH
	return info.stamped(stampedVersion, stampedRevision)
}

// stamped is i with what -ldflags stamped in place of Go's own.
func (i Info) stamped(version, revision string) Info {
	if version != "" {
		i.Version = version
		i.Modified = strings.HasSuffix(version, "-dirty")
	}
	if revision != "" {
		i.Revision = revision
	}
	return i
}

// FromBuildInfo extracts Info from a binary's build information.
func FromBuildInfo(bi *debug.BuildInfo) Info {
	info := Info{Version: bi.Main.Version, GoVersion: bi.GoVersion}
	if info.Version == "" {
		info.Version = "(devel)"
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			info.Revision = s.Value
		case "vcs.time":
			info.Time = s.Value
		case "vcs.modified":
			info.Modified = s.Value == "true"
		}
	}
	return info
}

// String is the one line `--version` prints after the program's name:
// version, short revision (+modified), commit time, Go version and
// platform.
func (i Info) String() string {
	var b strings.Builder
	b.WriteString(i.Version)
	if i.Revision != "" {
		rev := i.Revision
		if len(rev) > 12 {
			rev = rev[:12]
		}
		fmt.Fprintf(&b, " revision %s", rev)
		if i.Modified {
			b.WriteString(" (modified)")
		}
	}
	if i.Time != "" {
		fmt.Fprintf(&b, " %s", i.Time)
	}
	if i.GoVersion != "" {
		fmt.Fprintf(&b, " %s", i.GoVersion)
	}
	if i.Platform != "" {
		fmt.Fprintf(&b, " %s", i.Platform)
	}
	return b.String()
}
