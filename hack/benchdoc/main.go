// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command benchdoc rewrites the generated sections of docs/BENCHMARKS.md
// and README.md from bench/results.json without running the benchmark
// (make bench writes them after a run). Run it from the repository root.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
)

func main() {
	results := flag.String("results", "bench/results.json", "the results file")
	doc := flag.String("doc", "docs/BENCHMARKS.md", "the results page")
	readme := flag.String("readme", "README.md", "the README (its summary table); empty for none")
	flag.Parse()
	if err := run(*results, benchdoc.Files{Benchmarks: *doc, Readme: *readme}); err != nil {
		fmt.Fprintln(os.Stderr, "benchdoc:", err)
		os.Exit(1)
	}
}

func run(results string, files benchdoc.Files) error {
	r, err := benchdoc.ReadJSON(results)
	if err != nil {
		return err
	}
	return files.Write(r)
}
