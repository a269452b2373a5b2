// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package hostfs

import (
	"errors"
	"testing"
)

// Cgroup2Root finds this process's cgroup v2 hierarchy in its mountinfo.
func TestCgroup2RootIsACgroup2Mount(t *testing.T) {
	root, err := Cgroup2Root()
	if err != nil {
		t.Fatalf("Cgroup2Root: %v (the suites need a cgroup v2 hierarchy)", err)
	}
	if _, err := CgroupID(root); err != nil {
		t.Errorf("Cgroup2Root = %s: %v", root, err)
	}
}

func TestNoMountOfAType(t *testing.T) {
	if _, err := firstOfType("no-such-filesystem"); !errors.Is(err, ErrNotMounted) {
		t.Errorf("firstOfType of an absent type = %v, want ErrNotMounted", err)
	}
}
