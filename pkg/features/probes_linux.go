// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package features

import (
	"errors"
	"math"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"golang.org/x/sys/unix"
)

// liftMemlock removes the RLIMIT_MEMLOCK limit once, before the first
// probe: kernels before 5.11 charge BPF memory to it, and a probe program
// that does not fit a low limit (the agent probes before the data path
// loads) would look like a missing feature.
var liftMemlock = sync.OnceFunc(func() { _ = rlimit.RemoveMemlock() })

// Each probe runs once per process; a probe that cannot decide (an error
// other than ErrNotSupported) counts as "missing", so the data path takes
// the conservative mechanism.

// HasTCX reports TCX links (Linux 6.6).
var HasTCX = sync.OnceValue(func() bool { liftMemlock(); return probeTCX() == nil })

// HasSkLookup reports sk_lookup programs (Linux 5.9).
var HasSkLookup = sync.OnceValue(func() bool { liftMemlock(); return features.HaveProgramType(ebpf.SkLookup) == nil })

// HasSkLookupIfindex reports the ingress_ifindex field of sk_lookup
// programs (Linux 5.17): a program reading it loads only where the kernel
// has it.
var HasSkLookupIfindex = sync.OnceValue(func() bool {
	return loadsInsns(&ebpf.ProgramSpec{Type: ebpf.SkLookup, AttachType: ebpf.AttachSkLookup}, asm.Instructions{
		asm.LoadMem(asm.R0, asm.R1, skLookupIngressIfindexOff, asm.Word),
		asm.LoadImm(asm.R0, 1, asm.DWord), // SK_PASS
		asm.Return(),
	})
})

// skLookupIngressIfindexOff is offsetof(struct bpf_sk_lookup, ingress_ifindex).
const skLookupIngressIfindexOff = 64

// HasSkAssign reports bpf_sk_assign in TC programs (Linux 5.7).
var HasSkAssign = sync.OnceValue(func() bool { return helper(ebpf.SchedCLS, asm.FnSkAssign) })

// HasNetnsCookieSockAddr reports bpf_get_netns_cookie in cgroup sock_addr
// programs (Linux 5.7).
var HasNetnsCookieSockAddr = sync.OnceValue(func() bool { return helper(ebpf.CGroupSockAddr, asm.FnGetNetnsCookie) })

// HasCgroupGetpeername reports the cgroup getpeername4/6 hooks (Linux 5.8).
var HasCgroupGetpeername = sync.OnceValue(func() bool {
	return loads(&ebpf.ProgramSpec{Type: ebpf.CGroupSockAddr, AttachType: ebpf.AttachCgroupInet4GetPeername})
})

// HasSkStorageSockAddr reports bpf_sk_storage_get in cgroup sock_addr
// programs (Linux 5.8).
var HasSkStorageSockAddr = sync.OnceValue(func() bool { return helper(ebpf.CGroupSockAddr, asm.FnSkStorageGet) })

// HasSkStorageSockops reports bpf_sk_storage_get in sockops (Linux 5.8).
var HasSkStorageSockops = sync.OnceValue(func() bool { return helper(ebpf.SockOps, asm.FnSkStorageGet) })

// HasSONetnsCookie reports getsockopt(SO_NETNS_COOKIE) (Linux 5.14).
var HasSONetnsCookie = sync.OnceValue(func() bool {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	_, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
	return err == nil
})

// HasNetnsCookieSockops reports bpf_get_netns_cookie in sockops (Linux 5.15).
var HasNetnsCookieSockops = sync.OnceValue(func() bool { return helper(ebpf.SockOps, asm.FnGetNetnsCookie) })

// HasNetnsCookieSockopt reports bpf_get_netns_cookie in cgroup sockopt
// programs (Linux 5.15).
var HasNetnsCookieSockopt = sync.OnceValue(func() bool { return helper(ebpf.CGroupSockopt, asm.FnGetNetnsCookie) })

// HasSockmapAccel reports what the sockmap acceleration's programs call
// (bpf/accel.c): bpf_get_netns_cookie in sockops and sk_msg programs
// (Linux 5.15; BPF compare-and-swap, 5.12, comes before) and socket storage
// in sk_msg programs (5.8).
var HasSockmapAccel = sync.OnceValue(func() bool {
	return HasNetnsCookieSockops() && helper(ebpf.SkMsg, asm.FnGetNetnsCookie) && helper(ebpf.SkMsg, asm.FnSkStorageGet)
})

// HasSockmapLink reports bpf_links for sockmap programs (Linux 6.10): an
// sk_msg program linked to a sockhash.
var HasSockmapLink = sync.OnceValue(func() bool { return probeSockmapLink() == nil })

func helper(pt ebpf.ProgramType, fn asm.BuiltinFunc) bool {
	liftMemlock()
	return features.HaveProgramHelper(pt, fn) == nil
}

// loads reports whether a trivial program of spec's type and attach type
// loads: the kernel refuses attach types it does not know.
func loads(spec *ebpf.ProgramSpec) bool {
	return loadsInsns(spec, asm.Instructions{asm.LoadImm(asm.R0, 1, asm.DWord), asm.Return()})
}

// loadsInsns reports whether insns load as a program of spec's type.
func loadsInsns(spec *ebpf.ProgramSpec, insns asm.Instructions) bool {
	liftMemlock()
	spec.License = "GPL"
	spec.Instructions = insns
	prog, err := ebpf.NewProgram(spec)
	if err != nil {
		return false
	}
	prog.Close()
	return true
}

// probeTCX asks for a TCX link on an interface index that cannot exist:
// kernels with TCX answer ENODEV, older ones do not know the attach type
// (link.AttachTCX then reports ErrNotSupported from its own probe).
func probeTCX() error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SchedCLS,
		License:      "GPL",
		Instructions: asm.Instructions{asm.LoadImm(asm.R0, 0, asm.DWord), asm.Return()},
	})
	if err != nil {
		return err
	}
	defer prog.Close()
	l, err := link.AttachTCX(link.TCXOptions{Interface: math.MaxInt32, Program: prog, Attach: ebpf.AttachTCXIngress})
	if err == nil {
		l.Close()
		return errors.New("tcx probe attached to a missing interface")
	}
	if errors.Is(err, unix.ENODEV) {
		return nil
	}
	return err
}

// probeSockmapLink links a trivial sk_msg program to a one-entry sockhash;
// kernels before 6.10 refuse the attach type in BPF_LINK_CREATE.
func probeSockmapLink() error {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockHash, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return err
	}
	defer m.Close()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.SkMsg,
		AttachType:   ebpf.AttachSkMsgVerdict,
		License:      "GPL",
		Instructions: asm.Instructions{asm.LoadImm(asm.R0, 1, asm.DWord), asm.Return()}, // SK_PASS
	})
	if err != nil {
		return err
	}
	defer prog.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: m.FD(), Program: prog, Attach: ebpf.AttachSkMsgVerdict})
	if err != nil {
		return err
	}
	return l.Close()
}

// HasFentryTCPConnect reports fentry programs on the kernel's
// tcp_connect() (Linux 5.5 on x86-64, 6.0 on arm64: BPF trampolines and
// kernel BTF): a trivial one loads and attaches. A kernel may refuse them
// all the same (a BPF LSM policy, lockdown): that counts as missing.
var HasFentryTCPConnect = sync.OnceValue(func() bool { liftMemlock(); return probeFentryTCPConnect() == nil })

func probeFentryTCPConnect() error {
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.Tracing,
		AttachType:   ebpf.AttachTraceFEntry,
		AttachTo:     "tcp_connect",
		License:      "GPL",
		Instructions: asm.Instructions{asm.LoadImm(asm.R0, 0, asm.DWord), asm.Return()},
	})
	if err != nil {
		return err
	}
	defer prog.Close()
	l, err := link.AttachTracing(link.TracingOptions{Program: prog})
	if err != nil {
		return err
	}
	return l.Close()
}
