// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package testbin

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// hack/releases parses, and CHANGELOG.md has a section for each release
// naming its commit.
func TestReleasesMatchTheChangelog(t *testing.T) {
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := Root(wd)
	if err != nil {
		t.Fatal(err)
	}
	rs, err := Releases(root)
	if err != nil {
		t.Fatal(err)
	}
	changelog, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if !strings.Contains(string(changelog), "\n## "+r.Version+"\n") || !strings.Contains(string(changelog), r.Commit) {
			t.Errorf("CHANGELOG.md has no section for %s naming %s", r.Version, r.Commit)
		}
	}
	if last, err := Last(root); err != nil || last != rs[len(rs)-1] {
		t.Errorf("Last = %+v, %v", last, err)
	}
	if got, want := Name("github.com/x/cmd/agent", "a", "b"), "agent.a.b"; got != want {
		t.Errorf("Name = %q, want %q", got, want)
	}
}
