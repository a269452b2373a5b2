// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ambient-ebpf-agent is the node agent: it redirects enrolled pods'
// traffic to ztunnel with eBPF, hands pods to ztunnel over ZDS, and installs
// the CNI plugin. See pkg/agent.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
)

func main() {
	flags := agent.NewFlags(flag.CommandLine)
	flag.Parse()
	if flags.Version() {
		fmt.Println("ambient-ebpf-agent", buildinfo.Read())
		return
	}
	cfg, err := flags.Config()
	if err != nil {
		fmt.Fprintln(os.Stderr, "ambient-ebpf-agent:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := agent.Run(ctx, cfg); err != nil && !errors.Is(err, context.Canceled) {
		cfg.Logger.Error("agent failed", "error", err)
		stop()
		os.Exit(1)
	}
}
