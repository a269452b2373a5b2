// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package inspect

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
)

// ExclusiveHolder is a program that keeps ours off one of our socket hooks:
// attached with a plain BPF_PROG_ATTACH (no BPF_F_ALLOW_MULTI) to the
// cgroup root the agent attaches to, or to one of its ancestors without
// BPF_F_ALLOW_OVERRIDE either. While it is there the kernel refuses our
// attach (EPERM). Older Cilium releases attach their socket load balancer
// this way.
type ExclusiveHolder struct {
	Hook   string `json:"hook"` // connect4, sockops, ...
	Cgroup string `json:"cgroup"`
	ID     uint32 `json:"id"`
	Name   string `json:"name"`
}

func (h ExclusiveHolder) String() string {
	return fmt.Sprintf("program %s (id %d) holds %s of cgroup %s exclusively (attached without BPF_F_ALLOW_MULTI)", h.Name, h.ID, h.Hook, h.Cgroup)
}

// ExclusiveHolders lists the programs that would make attaching our socket
// programs to cgroup fail, looking at cgroup and its ancestors up to the
// cgroup v2 mount (mount; "" looks at cgroup alone).
func ExclusiveHolders(mount, cgroup string) ([]ExclusiveHolder, error) {
	var out []ExclusiveHolder
	for dir, self := filepath.Clean(cgroup), true; ; dir, self = filepath.Dir(dir), false {
		for _, h := range bpfobj.NodeHooks() {
			flags, ids, err := queryCgroupHook(dir, h.Attach)
			if err != nil {
				return out, err
			}
			if len(ids) == 0 || flags&unix.BPF_F_ALLOW_MULTI != 0 || !self && flags&unix.BPF_F_ALLOW_OVERRIDE != 0 {
				continue
			}
			for _, id := range ids {
				out = append(out, ExclusiveHolder{Hook: h.Name, Cgroup: dir, ID: id, Name: programName(ebpf.ProgramID(id))})
			}
		}
		if mount == "" || dir == filepath.Clean(mount) || !strings.HasPrefix(dir, filepath.Clean(mount)+"/") {
			return out, nil
		}
	}
}

// queryCgroupHook is BPF_PROG_QUERY on one hook of a cgroup: the hook's
// attach flags and its programs' ids. cilium/ebpf's QueryPrograms does not
// return the flags, which say whether the hook is shared.
func queryCgroupHook(dir string, attach ebpf.AttachType) (uint32, []uint32, error) {
	f, err := os.Open(dir)
	if err != nil {
		return 0, nil, fmt.Errorf("open cgroup %s: %w", dir, err)
	}
	defer f.Close()
	ids := make([]uint32, 64)
	attr := struct {
		targetFd    uint32
		attachType  uint32
		queryFlags  uint32
		attachFlags uint32
		progIDs     uint64
		progCount   uint32
		_           uint32
	}{targetFd: uint32(f.Fd()), attachType: uint32(attach), progIDs: uint64(uintptr(unsafe.Pointer(&ids[0]))), progCount: uint32(len(ids))}
	const bpfProgQuery = 16 // BPF_PROG_QUERY
	_, _, errno := unix.Syscall(unix.SYS_BPF, bpfProgQuery, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr))
	runtime.KeepAlive(ids)
	if errno != 0 && !errors.Is(errno, unix.ENOSPC) {
		return 0, nil, fmt.Errorf("query the %s programs of cgroup %s: %w", attach, dir, errno)
	}
	return attr.attachFlags, ids[:min(attr.progCount, uint32(len(ids)))], nil
}
