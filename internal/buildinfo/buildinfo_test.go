// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package buildinfo

import (
	"runtime/debug"
	"testing"
)

func TestFromBuildInfo(t *testing.T) {
	cases := []struct {
		name     string
		bi       debug.BuildInfo
		want     Info
		wantLine string
	}{
		{
			name: "release build from a clean checkout",
			bi: debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Path: "github.com/ambient-ebpf/ambient-ebpf", Version: "v0.1.0"},
				Settings: []debug.BuildSetting{
					{Key: "vcs", Value: "git"},
					{Key: "vcs.revision", Value: "0123456789abcdef0123456789abcdef01234567"},
					{Key: "vcs.time", Value: "2026-08-01T10:00:00Z"},
					{Key: "vcs.modified", Value: "false"},
				}},
			want: Info{Version: "v0.1.0", Revision: "0123456789abcdef0123456789abcdef01234567", Time: "2026-08-01T10:00:00Z",
				GoVersion: "go1.26.0"},
			wantLine: "v0.1.0 revision 0123456789ab 2026-08-01T10:00:00Z go1.26.0",
		},
		{
			name: "modified tree",
			bi: debug.BuildInfo{GoVersion: "go1.26.0", Main: debug.Module{Version: "v0.1.1-0.20260801100000-0123456789ab+dirty"},
				Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789ab"}, {Key: "vcs.modified", Value: "true"}}},
			want:     Info{Version: "v0.1.1-0.20260801100000-0123456789ab+dirty", Revision: "0123456789ab", Modified: true, GoVersion: "go1.26.0"},
			wantLine: "v0.1.1-0.20260801100000-0123456789ab+dirty revision 0123456789ab (modified) go1.26.0",
		},
		{
			name:     "no VCS information",
			bi:       debug.BuildInfo{GoVersion: "go1.26.0"},
			want:     Info{Version: "(devel)", GoVersion: "go1.26.0"},
			wantLine: "(devel) go1.26.0",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := FromBuildInfo(&tc.bi)
			if got != tc.want {
				t.Errorf("FromBuildInfo = %+v, want %+v", got, tc.want)
			}
			if line := got.String(); line != tc.wantLine {
				t.Errorf("String() = %q, want %q", line, tc.wantLine)
			}
		})
	}
}

// A version stamped with -ldflags (hack/version.sh's) takes the place of
// Go's "(devel)" of a linked worktree or a tree without .git.
func TestStamped(t *testing.T) {
	devel := Info{Version: "(devel)", GoVersion: "go1.26.0"}
	if got := devel.stamped("", ""); got != devel {
		t.Errorf("nothing stamped: %+v, want %+v", got, devel)
	}
	got := devel.stamped("v0.1.0-2-gfed2263-dirty", "fed2263aaaa")
	want := Info{Version: "v0.1.0-2-gfed2263-dirty", Revision: "fed2263aaaa", Modified: true, GoVersion: "go1.26.0"}
	if got != want {
		t.Errorf("stamped = %+v, want %+v", got, want)
	}
	if flags := LDFlags("v0.1.0", "abc"); flags != "-X github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo.stampedVersion=v0.1.0 -X github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo.stampedRevision=abc" {
		t.Errorf("LDFlags = %q", flags)
	}
}
