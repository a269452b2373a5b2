// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ambient-ebpf-cni-fallback decides, for the CNI plugin, whether a
// pod may start while the node agent is unreachable (pkg/cni/fallback/decide). The
// plugin execs it only then; the installer copies it next to the plugin.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback/decide"
)

func main() {
	// The plugin runs it with no arguments; --version is for people.
	if len(os.Args) == 2 && os.Args[1] == "--version" {
		fmt.Println("ambient-ebpf-cni-fallback", buildinfo.Read())
		return
	}
	if err := decide.Run(context.Background(), os.Stdin, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "ambient-ebpf-cni-fallback:", err)
		os.Exit(1)
	}
}
