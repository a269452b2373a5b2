// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package buildinfo reports what the Go toolchain stamped into a binary
// (runtime/debug.ReadBuildInfo): the module version, the VCS revision and
// whether the tree had local changes. Nothing is set with -ldflags, so a
// plain `go build` in a checkout gives the full answer; a build without
// VCS information (a source tree without .git) reports what it has.
package buildinfo

import (
	"fmt"
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
}

// Read returns the running binary's build information.
func Read() Info {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return Info{Version: "unknown"}
	}
	return FromBuildInfo(bi)
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
// version, short revision (+modified), commit time and Go version.
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
	return b.String()
}
