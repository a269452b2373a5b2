// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package githooks holds the repository's git hooks (make hooks installs
// them); its test runs them on commit messages.
package githooks

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The commit-msg hook takes a message that follows CONTRIBUTING.md and
// git's own subjects, and refuses a long subject, an uppercase or missing
// area, and a body that starts on the second line.
func TestCommitMsgHook(t *testing.T) {
	long := "dataplane: " + strings.Repeat("x", 100-len("dataplane: "))
	for _, c := range []struct {
		name, msg string
		ok        bool
	}{
		{"subject and body", "dataplane: refuse the node's own netns\n\nWhy, and what was measured.\n", true},
		{"subject alone", "docs: link the takeover runbook\n", true},
		{"72 characters", "docs: " + strings.Repeat("y", 66) + "\n", true},
		{"area with a slash", "test/bench: name the run in the summary\n", true},
		{"git's comments", "# Please enter the commit message\ncli: accept a relative socket\n\n# Changes to be committed:\n", true},
		{"merge", "Merge branch 'i31-docs' into main with a subject far longer than seventy-two characters\n", true},
		{"fixup", "fixup! dataplane: refuse the node's own netns\n", true},
		{"revert", "Revert \"dataplane: refuse the node's own netns\"\n\nThis reverts commit 0123456.\n", true},
		{"100 characters", long + "\n\nbody\n", false},
		{"uppercase area", "Dataplane: refuse the node's own netns\n", false},
		{"no area", "refuse the node's own netns\n", false},
		{"area with a space", "kernel matrix: run the takeover on 6.12\n", false},
		{"empty", "\n", false},
		{"body on the second line", "docs: link the runbook\nand say why\n", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := filepath.Join(t.TempDir(), "COMMIT_EDITMSG")
			if err := os.WriteFile(f, []byte(c.msg), 0o644); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command("./commit-msg", f).CombinedOutput()
			if ok := err == nil; ok != c.ok {
				t.Errorf("accepted %v, want %v: %q\n%s", ok, c.ok, c.msg, out)
			}
		})
	}
}
