// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bpfobj

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"

	"github.com/cilium/ebpf/link"
)

// ErrNotInstalled is returned when no data path is pinned at a directory
// (package inspect's ErrNotInstalled is this one).
var ErrNotInstalled = errors.New("no ambient-ebpf data path pinned here")

// The pins under the agent's bpffs directory (Config.BPFFSDir of package
// dataplane, which documents each pin).
func MapsDir(bpffsDir string) string  { return filepath.Join(bpffsDir, "maps") }
func LinksDir(bpffsDir string) string { return filepath.Join(bpffsDir, "links") }
func PodsDir(bpffsDir string) string  { return filepath.Join(bpffsDir, "pods") }

// ZtunnelDir holds, with per-pod socket hooks, the links of ztunnel's
// cgroups: one directory per cgroup id.
func ZtunnelDir(bpffsDir string) string { return filepath.Join(bpffsDir, "ztunnel") }

// PodDir is the directory of one pod's pins; uid must be validated first.
func PodDir(bpffsDir, uid string) string { return filepath.Join(PodsDir(bpffsDir), uid) }

// AddrKey is how the maps key an address: 16 bytes, IPv4 as ::ffff:a.b.c.d.
func AddrKey(ip netip.Addr) SockAeAddr { return SockAeAddr{B: ip.As16()} }

// Addr decodes AddrKey.
func Addr(a SockAeAddr) netip.Addr { return netip.AddrFrom16(a.B).Unmap() }

// Ntohs swaps a port between network and host order (the sockets' hooks
// keep ports as the kernel has them).
func Ntohs(v uint16) uint16 { return v>>8 | v<<8 }

// CString writes s into a fixed C char array, truncated and NUL-terminated.
func CString[T ~int8 | ~uint8](dst []T, s string) {
	clear(dst)
	for i := 0; i < len(s) && i < len(dst)-1; i++ {
		dst[i] = T(s[i])
	}
}

// GoString reads a fixed C char array up to its NUL.
func GoString[T ~int8 | ~uint8](src []T) string {
	b := make([]byte, 0, len(src))
	for _, c := range src {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	return string(b)
}

// SameCgroup checks that a pinned cgroup link is attached to the cgroup
// with id want (the configured root), not to one an earlier agent had.
func SameCgroup(l link.Link, want uint64) error {
	info, err := l.Info()
	if err != nil {
		return fmt.Errorf("read link info: %w", err)
	}
	cg := info.Cgroup()
	if cg == nil {
		return fmt.Errorf("link %d is not a cgroup link", info.ID)
	}
	if cg.CgroupId != want {
		return fmt.Errorf("attached to cgroup id %d, not the configured root's (id %d)", cg.CgroupId, want)
	}
	return nil
}
