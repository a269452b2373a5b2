// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package benchdoc

import (
	"os"
	"path/filepath"
	"testing"
)

// The committed README and docs/BENCHMARKS.md quote the committed
// bench/results.json exactly: every generated section is what the
// generator writes from it, so no figure drifts from the run it names.
// After a hand edit of a section or of results.json: go run ./hack/benchdoc.
func TestCommittedSectionsMatchTheResults(t *testing.T) {
	root := filepath.Join("..", "..", "..")
	r, err := ReadJSON(filepath.Join(root, "bench", "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	files := Files{Benchmarks: filepath.Join(root, "docs", "BENCHMARKS.md"), Readme: filepath.Join(root, "README.md")}
	for path, secs := range files.Sections() {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		want, err := Replace(string(b), r, secs...)
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if want != string(b) {
			t.Errorf("%s differs from what bench/results.json gives; run go run ./hack/benchdoc", path)
		}
	}
}

// A file without a section's markers is refused, not appended to.
func TestReplaceRefusesAFileWithoutMarkers(t *testing.T) {
	if _, err := Replace("# Benchmarks\n", &Results{}, SummaryTable); err == nil {
		t.Error("Replace accepted a file without markers")
	}
}
