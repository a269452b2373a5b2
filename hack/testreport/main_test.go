// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"strings"
	"testing"
)

func TestRunSummarizes(t *testing.T) {
	cases := []struct {
		name       string
		in         string
		failOnSkip bool
		wantCode   int
		wantLine   string
	}{
		{"pass", `{"Action":"pass","Package":"p","Test":"T"}`, false, 0, "1 passed, 0 failed, 0 skipped"},
		{"fail", `{"Action":"fail","Package":"p","Test":"T"}`, false, 1, "0 passed, 1 failed, 0 skipped"},
		{"skip allowed", `{"Action":"pass","Package":"p","Test":"A"}` + "\n" + `{"Action":"skip","Package":"p","Test":"T"}`, false, 0, "1 passed, 0 failed, 1 skipped"},
		{"skip under CI", `{"Action":"pass","Package":"p","Test":"A"}` + "\n" + `{"Action":"skip","Package":"p","Test":"T"}`, true, 1, "1 passed, 0 failed, 1 skipped"},
		{"package build failure", `{"Action":"fail","Package":"p"}`, false, 1, "0 passed, 0 failed, 0 skipped"},
		{"nothing ran", ``, false, 1, "0 passed, 0 failed, 0 skipped"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var out strings.Builder
			code := run(strings.NewReader(tc.in), &out, tc.failOnSkip)
			if code != tc.wantCode {
				t.Errorf("exit code %d, want %d; output:\n%s", code, tc.wantCode, out.String())
			}
			if !strings.Contains(out.String(), tc.wantLine) {
				t.Errorf("output lacks %q:\n%s", tc.wantLine, out.String())
			}
		})
	}
}

func TestRunRepeatsTheFailureMessagesLast(t *testing.T) {
	in := strings.Join([]string{
		`{"Action":"output","Package":"p","Test":"TestA","Output":"    a_test.go:12: the drain table is left\n"}`,
		`{"Action":"output","Package":"p","Test":"TestA","Output":"        time=x level=INFO msg=long agent log\n"}`,
		`{"Action":"output","Package":"p","Test":"TestB","Output":"    b_test.go:3: only logged\n"}`,
		`{"Action":"fail","Package":"p","Test":"TestA"}`,
		`{"Action":"pass","Package":"p","Test":"TestB"}`,
	}, "\n")
	var out strings.Builder
	if code := run(strings.NewReader(in), &out, false); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	tail := out.String()[strings.Index(out.String(), "level=INFO"):]
	if !strings.Contains(tail, "testreport: TestA: a_test.go:12: the drain table is left") {
		t.Errorf("the failure is not repeated after the log:\n%s", out.String())
	}
	if strings.Contains(tail, "testreport: TestB") {
		t.Errorf("a passing test's lines are repeated:\n%s", out.String())
	}
}
