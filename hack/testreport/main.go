// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command testreport reads `go test -json` output on stdin, prints the
// human-readable test output, and closes with one summary line
// "testreport: N passed, N failed, N skipped". With -fail-on-skip (set by
// the Makefile when CI=true) a skipped test fails the run: a kernel suite that
// could not run what it claims to test must not look green.
//
// A failing test's message lines (those that start with a test file's
// position, as t.Errorf and t.Fatalf print them) are repeated above the
// summary: CI shows the end of a run, and a long agent log printed after
// the failure would otherwise hide why it failed.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strings"
)

// located matches the first line of a message printed by t.Errorf, t.Fatalf
// or t.Logf: indented, then "file_test.go:123: ".
var locatedLine = regexp.MustCompile(`^\s+[\w.-]+_test\.go:\d+: `)

const (
	maxLocated   = 12  // message lines repeated per failing test
	maxLocatedLn = 300 // characters kept of each
)

type event struct {
	Action  string
	Package string
	Test    string
	Output  string
}

func main() {
	failOnSkip := flag.Bool("fail-on-skip", false, "treat skipped tests as failures")
	flag.Parse()
	os.Exit(run(os.Stdin, os.Stdout, *failOnSkip))
}

func run(in io.Reader, out io.Writer, failOnSkip bool) int {
	var passed, failed int
	var skipped, failures []string
	pkgFailed := false
	messages := map[string][]string{} // package+" "+test -> located lines
	var located []string              // failing tests' lines, in order
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1024*1024), 16*1024*1024)
	for sc.Scan() {
		line := sc.Bytes()
		var ev event
		if err := json.Unmarshal(line, &ev); err != nil {
			// Build failures and other non-JSON lines are passed through.
			fmt.Fprintln(out, string(line))
			continue
		}
		switch ev.Action {
		case "output":
			fmt.Fprint(out, ev.Output)
			if ev.Test != "" && locatedLine.MatchString(ev.Output) {
				k := ev.Package + " " + ev.Test
				if len(messages[k]) < maxLocated {
					messages[k] = append(messages[k], truncate(strings.TrimSpace(ev.Output), maxLocatedLn))
				}
			}
		case "pass":
			if ev.Test != "" {
				passed++
			}
		case "fail":
			if ev.Test != "" {
				failed++
				k := ev.Package + " " + ev.Test
				failures = append(failures, k)
				for _, m := range messages[k] {
					located = append(located, ev.Test+": "+m)
				}
			} else {
				pkgFailed = true
				failures = append(failures, ev.Package+" (package)")
			}
		case "skip":
			if ev.Test != "" {
				skipped = append(skipped, ev.Package+" "+ev.Test)
			}
		}
	}
	if err := sc.Err(); err != nil {
		fmt.Fprintf(out, "testreport: read test output: %v\n", err)
		return 1
	}
	sort.Strings(skipped)
	for _, s := range skipped {
		fmt.Fprintf(out, "testreport: skipped %s\n", s)
	}
	for _, m := range located {
		fmt.Fprintf(out, "testreport: %s\n", m)
	}
	for _, f := range failures {
		fmt.Fprintf(out, "testreport: FAILED %s\n", f)
	}
	fmt.Fprintf(out, "testreport: %d passed, %d failed, %d skipped\n", passed, failed, len(skipped))
	switch {
	case failed > 0 || pkgFailed:
		return 1
	case failOnSkip && len(skipped) > 0:
		fmt.Fprintln(out, "testreport: skipped tests fail the run under CI=true")
		return 1
	case passed == 0:
		fmt.Fprintln(out, "testreport: no test ran")
		return 1
	}
	return 0
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
