// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Conntrack of one netns, for conntrack_entries_per_conn and the churn
// run. The kernel keeps a table per netns; its count is held against the
// one global nf_conntrack_max, which only the initial netns may change
// (the sysctl is read-only elsewhere on this kernel).

const (
	ctCountSysctl = "/proc/sys/net/netfilter/nf_conntrack_count"
	ctMaxSysctl   = "/proc/sys/net/netfilter/nf_conntrack_max"
)

// ctCount is the number of conntrack entries in a netns.
func ctCount(ns string) (int, error) {
	var n int
	err := simnode.InNetns(ns, func() error {
		b, err := os.ReadFile(ctCountSysctl)
		if err != nil {
			return err
		}
		n, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err
	})
	return n, err
}

// ctMax is the limit every netns's table is held to.
func ctMax() (int, error) {
	b, err := os.ReadFile(ctMaxSysctl)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// ctFlush empties a netns's conntrack table.
func ctFlush(ns string) error {
	h, err := netns.GetFromPath(simnode.NetnsPath(ns))
	if err != nil {
		return fmt.Errorf("open netns %s: %w", ns, err)
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netlink in %s: %w", ns, err)
	}
	defer nl.Close()
	if err := nl.ConntrackTableFlush(netlink.ConntrackTable); err != nil {
		return fmt.Errorf("flush conntrack in %s: %w", ns, err)
	}
	return nil
}

// Netlink constants of ctnetlink (linux/netfilter/nfnetlink_conntrack.h)
// that x/sys/unix does not carry.
const (
	nfnlSubsysCtnetlink = 1
	ipctnlMsgCtNew      = 0
	ctaTupleOrig        = 1
	ctaTupleReply       = 2
	ctaStatus           = 3
	ctaProtoinfo        = 4
	ctaTimeout          = 7
	ctaMark             = 8
	ctaTupleIP          = 1
	ctaTupleProto       = 2
	ctaIPv4Src          = 1
	ctaIPv4Dst          = 2
	ctaProtoNum         = 1
	ctaProtoSrcPort     = 2
	ctaProtoDstPort     = 3
	ctaProtoinfoTCP     = 1
	ctaProtoinfoTCPSt   = 1
	ipsSeenReply        = 1 << 1
	ipsAssured          = 1 << 2
	ipsConfirmed        = 1 << 3
	tcpConntrackEst     = 3
	nlaFNested          = 1 << 15
	// fillerMark is the ctmark of filler entries.
	fillerMark = 0x5eed
)

// ctFill adds n established, assured TCP entries to a netns's conntrack
// table through ctnetlink (as `conntrack -I --status ASSURED` would): a
// pod holding that many connections. The kernel's early drop, which makes
// room for a new entry when the table is full, passes over assured
// entries, and the garbage collector evicts assured ones only in closing
// states, so these stay for their hour. Their tuples are in 198.19.224.0/20,
// which no interface of the node has: no packet ever matches one. The
// requests go in batches without acks (the kernel answers only errors).
func ctFill(ns string, n int) error {
	var fd int
	if err := simnode.InNetns(ns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		return err
	}); err != nil {
		return fmt.Errorf("netlink socket in %s: %w", ns, err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("bind netlink socket: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 4<<20)
	dst := &unix.SockaddrNetlink{Family: unix.AF_NETLINK}
	buf := make([]byte, 0, 64<<10)
	var errs []error
	drain := func() {
		rb := make([]byte, 64<<10)
		for {
			m, _, err := unix.Recvfrom(fd, rb, unix.MSG_DONTWAIT)
			if err != nil || m <= 0 {
				return
			}
			msgs, err := syscall.ParseNetlinkMessage(rb[:m])
			if err != nil {
				errs = append(errs, err)
				return
			}
			for _, msg := range msgs {
				if msg.Header.Type == syscall.NLMSG_ERROR && len(msg.Data) >= 4 {
					if e := int32(binary.NativeEndian.Uint32(msg.Data)); e != 0 && len(errs) < 3 {
						errs = append(errs, unix.Errno(-e))
					}
				}
			}
		}
	}
	for i := range n {
		buf = appendFiller(buf, uint32(i))
		if len(buf) > cap(buf)-512 || i == n-1 {
			if err := unix.Sendto(fd, buf, 0, dst); err != nil {
				return fmt.Errorf("send conntrack entries to %s: %w", ns, err)
			}
			buf = buf[:0]
			drain()
		}
	}
	drain()
	if len(errs) > 0 {
		return fmt.Errorf("add conntrack entries in %s: %w", ns, errors.Join(errs...))
	}
	return nil
}

// appendFiller appends the IPCTNL_MSG_CT_NEW request of filler entry i:
// 198.19.224.0/20 (by i / 60000) port 1024 + i % 60000 to 198.19.240.1:9.
func appendFiller(b []byte, i uint32) []byte {
	start := len(b)
	b = binary.NativeEndian.AppendUint32(b, 0) // nlmsg_len, set below
	b = binary.NativeEndian.AppendUint16(b, nfnlSubsysCtnetlink<<8|ipctnlMsgCtNew)
	b = binary.NativeEndian.AppendUint16(b, unix.NLM_F_REQUEST|unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b = binary.NativeEndian.AppendUint32(b, i+1) // seq
	b = binary.NativeEndian.AppendUint32(b, 0)   // pid
	b = append(b, unix.AF_INET, 0, 0, 0)         // nfgenmsg: family, version, res_id
	src := [4]byte{198, 19, 224, byte(i / 60000)}
	dst := [4]byte{198, 19, 240, 1}
	sport, dport := uint16(1024+i%60000), uint16(9)
	tuple := func(b []byte, typ uint16, s, d [4]byte, sp, dp uint16) []byte {
		return nest(b, typ, func(b []byte) []byte {
			b = nest(b, ctaTupleIP, func(b []byte) []byte {
				b = attr(b, ctaIPv4Src, s[:])
				return attr(b, ctaIPv4Dst, d[:])
			})
			return nest(b, ctaTupleProto, func(b []byte) []byte {
				b = attr(b, ctaProtoNum, []byte{unix.IPPROTO_TCP})
				b = attr(b, ctaProtoSrcPort, binary.BigEndian.AppendUint16(nil, sp))
				return attr(b, ctaProtoDstPort, binary.BigEndian.AppendUint16(nil, dp))
			})
		})
	}
	b = tuple(b, ctaTupleOrig, src, dst, sport, dport)
	b = tuple(b, ctaTupleReply, dst, src, dport, sport)
	b = attr(b, ctaStatus, binary.BigEndian.AppendUint32(nil, ipsSeenReply|ipsAssured|ipsConfirmed))
	b = attr(b, ctaTimeout, binary.BigEndian.AppendUint32(nil, 3600))
	b = attr(b, ctaMark, binary.BigEndian.AppendUint32(nil, fillerMark))
	b = nest(b, ctaProtoinfo, func(b []byte) []byte {
		return nest(b, ctaProtoinfoTCP, func(b []byte) []byte { return attr(b, ctaProtoinfoTCPSt, []byte{tcpConntrackEst}) })
	})
	binary.NativeEndian.PutUint32(b[start:], uint32(len(b)-start))
	return b
}

// attr appends a netlink attribute, padded to 4 bytes.
func attr(b []byte, typ uint16, v []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(4+len(v)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// nest appends a nested attribute whose contents body appends.
func nest(b []byte, typ uint16, body func([]byte) []byte) []byte {
	start := len(b)
	b = binary.NativeEndian.AppendUint32(b, 0)
	b = body(b)
	binary.NativeEndian.PutUint16(b[start:], uint16(len(b)-start))
	binary.NativeEndian.PutUint16(b[start+2:], typ|nlaFNested)
	return b
}
