// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
)

// The test binary stands in for the command when runMainEnv is set.
const runMainEnv = "AMBIENT_EBPF_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// --version prints the name and the build information and does nothing else.
func TestVersionFlag(t *testing.T) {
	cmd := exec.Command(os.Args[0], "--version")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("--version: %v\n%s", err, out)
	}
	if want := "ambient-ebpf-agent " + buildinfo.Read().String() + "\n"; string(out) != want {
		t.Errorf("--version printed %q, want %q", out, want)
	}
	if !strings.Contains(string(out), buildinfo.Read().GoVersion) {
		t.Errorf("--version lacks the Go version: %q", out)
	}
}
