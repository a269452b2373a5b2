// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package buildinfotest checks a command's --version from its own test
// binary: TestMain runs the command's main instead of the tests when the
// binary is started as the command.
//
//	func TestMain(m *testing.M) { buildinfotest.Main(m, main) }
//	func TestVersionFlag(t *testing.T) { buildinfotest.VersionFlag(t, "ambient-ebpf") }
package buildinfotest

import (
	"os"
	"os/exec"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
)

// runMainEnv tells the test binary to be the command.
const runMainEnv = "AMBIENT_EBPF_TEST_RUN_MAIN"

// Main runs main when the test binary was started as the command, the
// tests otherwise, and exits.
func Main(m *testing.M, main func()) {
	if os.Getenv(runMainEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// VersionFlag runs the command with --version and checks that it prints
// "<name> <build information>" and nothing else.
func VersionFlag(t *testing.T, name string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "--version")
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("--version: %v\n%s", err, out)
	}
	if want := name + " " + buildinfo.Read().String() + "\n"; string(out) != want {
		t.Errorf("--version printed %q, want %q", out, want)
	}
}
