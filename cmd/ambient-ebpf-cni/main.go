// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ambient-ebpf-cni is the chained CNI plugin; the installer copies it
// into the host's CNI bin directory. All logic is in pkg/cni/plugin.
package main

import (
	"log/slog"
	"os"

	"github.com/containernetworking/cni/pkg/skel"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/plugin"
)

func main() {
	// stdout carries the CNI result; logs go to stderr, which runtimes keep.
	log := slog.New(slog.NewTextHandler(os.Stderr, nil)).With("plugin", plugin.PluginType)
	p := plugin.New(os.Stdout, log)
	skel.PluginMainFuncs(p.Funcs(), plugin.VersionInfo(), plugin.About)
}
