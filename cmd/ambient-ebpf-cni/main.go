// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ambient-ebpf-cni is the chained CNI plugin; the installer copies it
// into the host's CNI bin directory. All logic is in pkg/cni/plugin.
package main

import (
	"fmt"
	"log/slog"
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

func main() {
	// Runtimes call a plugin with CNI_COMMAND and no arguments; --version
	// is for people.
	if len(os.Args) == 2 && os.Args[1] == "--version" {
		fmt.Println("ambient-ebpf-cni", buildinfo.Read())
		return
	}
	// stdout carries the CNI result; logs go to stderr, which runtimes keep.
	log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("plugin", plugin.PluginType)
	p := plugin.New(os.Stdout, log)
	skel.PluginMainFuncs(p.Funcs(), plugin.VersionInfo(), plugin.About)
}
