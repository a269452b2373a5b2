// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package podnetns

import (
	"fmt"
	"os"
	"syscall"
)

// statNetNS returns the device and inode of the namespace file at path
// (following the /proc/<pid>/ns/net magic link to its nsfs inode).
func statNetNS(path string) (dev, ino uint64, err error) {
	fi, err := os.Stat(path)
	if err != nil {
		return 0, 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0, fmt.Errorf("stat %s: no device and inode", path)
	}
	return uint64(st.Dev), st.Ino, nil //nolint:unconvert // Dev is not uint64 on every arch
}
