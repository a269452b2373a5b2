// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command testbins builds the binaries the end-to-end tests run into a
// directory, for runs without a Go toolchain or git (hack/vmtest passes it
// to the guest as AMBIENT_EBPF_TEST_BINS): this tree's agent, its
// test-only next-layout build, and the last release's agent.
//
//	go run ./hack/testbins -o DIR
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
)

func main() {
	out := flag.String("o", "", "directory to build into")
	flag.Parse()
	if *out == "" {
		fmt.Fprintln(os.Stderr, "testbins: -o DIR is required")
		os.Exit(2)
	}
	wd, err := os.Getwd()
	if err == nil {
		var root string
		if root, err = testbin.Root(wd); err == nil {
			err = testbin.Prebuild(root, *out, []string{"github.com/ambient-ebpf/ambient-ebpf/cmd/ambient-ebpf-agent"},
				[][]string{nil, {"ae_layout_next"}})
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "testbins:", err)
		os.Exit(1)
	}
}
