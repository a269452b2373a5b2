// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package hostfs finds the host filesystems the data path needs: the cgroup
// v2 hierarchy (wherever this node mounted it) and a bpffs for pins.
package hostfs

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
)

// Mount is one line of /proc/self/mountinfo, reduced to what we use.
type Mount struct {
	MountPoint string
	FSType     string
}

// ParseMountInfo reads mountinfo(5) lines.
func ParseMountInfo(r io.Reader) ([]Mount, error) {
	var mounts []Mount
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		// The optional fields end at "-", followed by fstype and source.
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if len(fields) < 5 || sep < 0 || sep+1 >= len(fields) {
			return nil, fmt.Errorf("malformed mountinfo line %q", sc.Text())
		}
		mounts = append(mounts, Mount{MountPoint: unescape(fields[4]), FSType: fields[sep+1]})
	}
	return mounts, sc.Err()
}

// unescape undoes the octal escapes mountinfo uses for spaces and the like.
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// ErrNotMounted is returned when no mount of the wanted type exists.
var ErrNotMounted = errors.New("not mounted")

// Mounts reads the calling process's mount table.
func Mounts() ([]Mount, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	mounts, err := ParseMountInfo(f)
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	return mounts, nil
}

func firstOfType(fstype string) (string, error) {
	mounts, err := Mounts()
	if err != nil {
		return "", err
	}
	for _, m := range mounts {
		if m.FSType == fstype {
			return m.MountPoint, nil
		}
	}
	return "", fmt.Errorf("%s: %w", fstype, ErrNotMounted)
}

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy
// (/sys/fs/cgroup on most nodes, /sys/fs/cgroup/unified on hybrid ones).
func Cgroup2Root() (string, error) {
	return firstOfType("cgroup2")
}
