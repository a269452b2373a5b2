// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build !linux

package podnetns

import "errors"

func statNetNS(string) (dev, ino uint64, err error) {
	return 0, 0, errors.New("network namespaces need linux")
}
