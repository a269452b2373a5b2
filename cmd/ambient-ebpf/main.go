// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ambient-ebpf inspects ambient-ebpf on a node.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := cli.NewCommand(os.Stdout).ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "ambient-ebpf:", err)
		stop()
		os.Exit(1)
	}
}
