// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"os"

	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// SocketProgramsOn counts the BPF programs attached to the cgroup dir
// itself (not those it inherits) on every socket hook the data path uses,
// anyone's.
func SocketProgramsOn(t TB, dir string) int {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	for _, h := range bpfobj.NodeHooks() {
		q, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: h.Attach})
		if err != nil {
			t.Fatalf("query %s on %s: %v", h.Name, dir, err)
		}
		n += len(q.Programs)
	}
	return n
}
