// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package zdswire moves single ZDS datagrams over a SOCK_SEQPACKET unix
// socket and decodes them with Istio's published types
// (istio.io/istio/pkg/zdsapi). Both ends use it: the agent's server in
// pkg/zds and the ztunnel stand-in's client in test/ztunnel/zdsclient.
//
// One protobuf message travels per datagram, at most MaxDatagram bytes. A
// larger datagram is detected from the kernel's MSG_TRUNC flag and rejected,
// never decoded from its cut prefix. File descriptors travel as SCM_RIGHTS;
// Recv hands every received descriptor to the caller or closes it, so a
// misbehaving peer cannot leak descriptors into this process.
package zdswire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

// MaxDatagram is the largest ZDS message either side accepts.
const MaxDatagram = 1024

// maxFDs bounds how many descriptors one datagram may bring in; a peer that
// sends more has the excess dropped by the kernel (MSG_CTRUNC), which Recv
// reports as an error after closing what did arrive.
const maxFDs = 8

// Errors a caller can branch on. Each is wrapped with detail.
var (
	// ErrOversized: the datagram was larger than MaxDatagram (MSG_TRUNC).
	ErrOversized = errors.New("oversized datagram")
	// ErrControlTruncated: ancillary data did not fit (MSG_CTRUNC).
	ErrControlTruncated = errors.New("ancillary data truncated")
	// ErrControlMalformed: ancillary data that does not parse.
	ErrControlMalformed = errors.New("malformed ancillary data")
	// ErrUnknownMessage: the datagram decoded but carries no known payload.
	ErrUnknownMessage = errors.New("unknown message")
	// ErrDecode: the datagram is not a valid protobuf of the expected type.
	ErrDecode = errors.New("undecodable message")
)

// Send marshals m and writes it as one datagram, with fds (if any) as one
// SCM_RIGHTS message; the caller keeps ownership of fds.
func Send(c *net.UnixConn, m proto.Message, fds ...int) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return fmt.Errorf("marshal %T: %w", m, err)
	}
	if len(b) > MaxDatagram {
		return fmt.Errorf("marshal %T: %d bytes: %w", m, len(b), ErrOversized)
	}
	return SendRaw(c, b, fds...)
}

// SendRaw writes b as one datagram, with fds (if any) as SCM_RIGHTS. Tests
// use it to send hand-crafted bytes.
func SendRaw(c *net.UnixConn, b []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	n, oobn, err := c.WriteMsgUnix(b, oob, nil)
	if err != nil {
		return fmt.Errorf("write datagram: %w", err)
	}
	if n != len(b) || oobn != len(oob) {
		return fmt.Errorf("write datagram: short write %d/%d bytes, %d/%d control", n, len(b), oobn, len(oob))
	}
	return nil
}

// Recv reads one datagram. On success the caller owns every returned
// descriptor. On error every received descriptor is already closed. A
// closed peer yields an error wrapping io.EOF.
func Recv(c *net.UnixConn) ([]byte, []int, error) {
	buf := make([]byte, MaxDatagram)
	oob := make([]byte, unix.CmsgSpace(maxFDs*4))
	n, oobn, flags, _, rerr := c.ReadMsgUnix(buf, oob)
	// Descriptors may arrive alongside any error (even a zero-length
	// datagram that Go reports as EOF), so collect them first.
	fds, perr := ParseRights(oob[:oobn])
	err := errors.Join(rerr, perr)
	switch {
	case err != nil:
	case flags&unix.MSG_TRUNC != 0:
		err = fmt.Errorf("datagram larger than %d bytes: %w", MaxDatagram, ErrOversized)
	case flags&unix.MSG_CTRUNC != 0:
		err = fmt.Errorf("more than %d descriptors: %w", maxFDs, ErrControlTruncated)
	}
	if err != nil {
		CloseAll(fds)
		if errors.Is(rerr, io.EOF) {
			return nil, nil, fmt.Errorf("peer closed the connection: %w", err)
		}
		return nil, nil, fmt.Errorf("read datagram: %w", err)
	}
	return buf[:n], fds, nil
}

// ParseRights returns the descriptors carried as SCM_RIGHTS in oob. It does
// not close anything; descriptors found before a parse error are returned
// with the error so the caller can close them.
//
// It decodes the descriptor array itself instead of calling
// unix.ParseUnixRights, which indexes past its slice (and panics) when a
// message's data is not a whole number of 4-byte descriptors. The kernel
// never writes such a message, but oob is what a peer caused to arrive.
func ParseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("parse control message: %w: %w", ErrControlMalformed, err)
	}
	var fds []int
	for i := range msgs {
		if msgs[i].Header.Level != unix.SOL_SOCKET || msgs[i].Header.Type != unix.SCM_RIGHTS {
			continue
		}
		data := msgs[i].Data
		if len(data)%4 != 0 {
			return fds, fmt.Errorf("parse rights: %d bytes of descriptors, not a multiple of 4: %w", len(data), ErrControlMalformed)
		}
		for ; len(data) > 0; data = data[4:] {
			fds = append(fds, int(int32(binary.NativeEndian.Uint32(data))))
		}
	}
	return fds, nil
}

// CloseAll closes every descriptor in fds.
func CloseAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// DecodeHello decodes ztunnel's first datagram and requires version V1.
func DecodeHello(b []byte) (*zdsapi.ZdsHello, error) {
	var h zdsapi.ZdsHello
	if err := proto.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("hello: %w: %w", ErrDecode, err)
	}
	// Any version from V1 on is accepted (Z1): istio-cni only logs it, so
	// a future ztunnel that says a higher version still connects, and
	// speaks what V1 defines.
	if h.GetVersion() < zdsapi.Version_V1 {
		return nil, fmt.Errorf("hello: unsupported version %v: %w", h.GetVersion(), ErrUnknownMessage)
	}
	return &h, nil
}

// DecodeResponse decodes a ztunnel-to-agent datagram and returns its Ack.
func DecodeResponse(b []byte) (*zdsapi.Ack, error) {
	var r zdsapi.WorkloadResponse
	if err := proto.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("response: %w: %w", ErrDecode, err)
	}
	ack := r.GetAck()
	if ack == nil {
		return nil, fmt.Errorf("response without ack: %w", ErrUnknownMessage)
	}
	return ack, nil
}

// DecodeRequest decodes an agent-to-ztunnel datagram and requires one of
// the known payloads (add, keep, del, snapshot_sent).
func DecodeRequest(b []byte) (*zdsapi.WorkloadRequest, error) {
	var r zdsapi.WorkloadRequest
	if err := proto.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("request: %w: %w", ErrDecode, err)
	}
	switch r.GetPayload().(type) {
	case *zdsapi.WorkloadRequest_Add, *zdsapi.WorkloadRequest_Keep,
		*zdsapi.WorkloadRequest_Del, *zdsapi.WorkloadRequest_SnapshotSent:
		return &r, nil
	default:
		return nil, fmt.Errorf("request without known payload: %w", ErrUnknownMessage)
	}
}
