// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zdswire

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"
)

func marshal(tb testing.TB, m proto.Message) []byte {
	tb.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// rejected reports whether a decoder rejected its input, and fails the test
// when it did so with an error a caller cannot branch on.
func rejected(t *testing.T, err error) bool {
	t.Helper()
	if err != nil && !errors.Is(err, ErrDecode) && !errors.Is(err, ErrUnknownMessage) {
		t.Fatalf("untyped error %v", err)
	}
	return err != nil
}

func responseSeeds(tb testing.TB) [][]byte {
	ack := marshal(tb, &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{}}})
	nack := marshal(tb, &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{Error: "listen 15001: address in use"}}})
	return [][]byte{
		ack, nack, nack[:len(nack)-4], {}, {0xff}, {0x0a}, {0x0a, 0x7f},
		{0x48, 0x01},             // unknown field 9
		{0x08, 0x01},             // a hello, not a response
		{0x0a, 0x02, 0x0a, 0x80}, // ack whose error string is cut
		bytes.Repeat([]byte{0x0a, 0x00}, 600),
	}
}

// FuzzDecodeResponse: any bytes from ztunnel either decode to an Ack that
// survives a round trip through Istio's type, or fail with a typed error.
func FuzzDecodeResponse(f *testing.F) {
	for _, s := range responseSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		ack, err := DecodeResponse(b)
		if rejected(t, err) {
			return
		}
		if ack == nil {
			t.Fatal("nil ack without error")
		}
		again, err := DecodeResponse(marshal(t, &zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: ack}}))
		if err != nil || again.GetError() != ack.GetError() {
			t.Fatalf("round trip: %v, %q vs %q", err, again.GetError(), ack.GetError())
		}
	})
}

// FuzzDecodeHello: only a decodable ZdsHello with version V1 or later is
// accepted (Z1: a newer ztunnel still connects).
func FuzzDecodeHello(f *testing.F) {
	for _, s := range [][]byte{{0x08, 0x01}, {0x08, 0x00}, {0x08, 0x02}, {}, {0x08}, {0xff, 0xff}, {0x0a, 0x00}} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := DecodeHello(b)
		if rejected(t, err) {
			return
		}
		if h.GetVersion() < zdsapi.Version_V1 {
			t.Fatalf("accepted version %v", h.GetVersion())
		}
	})
}

// FuzzDecodeRequest covers the stand-in's side: only the four known
// payloads are accepted.
func FuzzDecodeRequest(f *testing.F) {
	add := marshal(f, &zdsapi.WorkloadRequest{Payload: &zdsapi.WorkloadRequest_Add{Add: &zdsapi.AddWorkload{
		Uid: "u", WorkloadInfo: &zdsapi.WorkloadInfo{Name: "n", Namespace: "ns", ServiceAccount: "sa"},
	}}})
	for _, s := range [][]byte{add, add[:len(add)-2], {0x1a, 0x00}, {0x12, 0x03, 0x12, 0x01, 'u'}, {0x2a, 0x03, 0x0a, 0x01, 'u'}, {0x22, 0x00}, {}, {0x80}} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		if rejected(t, err) {
			return
		}
		if r.GetPayload() == nil {
			t.Fatal("accepted a request without payload")
		}
	})
}

// rightsWithDataLen is one SCM_RIGHTS control message whose header claims
// n bytes of descriptors, with room for them.
func rightsWithDataLen(n int) []byte {
	oob := make([]byte, unix.CmsgSpace(n))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level, h.Type = unix.SOL_SOCKET, unix.SCM_RIGHTS
	h.SetLen(unix.CmsgLen(n))
	for i := unix.CmsgLen(0); i < len(oob); i++ {
		oob[i] = 3
	}
	return oob
}

// TestParseRightsRefusesPartialDescriptors: a rights message whose length is
// not a multiple of 4 made unix.ParseUnixRights panic; it is an error that
// still returns the descriptors of the whole messages before it.
func TestParseRightsRefusesPartialDescriptors(t *testing.T) {
	for _, n := range []int{1, 2, 3, 5, 7, 9} {
		if _, err := ParseRights(rightsWithDataLen(n)); !errors.Is(err, ErrControlMalformed) {
			t.Errorf("%d bytes of descriptors: %v", n, err)
		}
	}
	fds, err := ParseRights(append(unix.UnixRights(7, 8), rightsWithDataLen(5)...))
	if !errors.Is(err, ErrControlMalformed) || len(fds) != 2 || fds[0] != 7 || fds[1] != 8 {
		t.Errorf("whole message then a partial one: %v, %v", fds, err)
	}
	fds, err = ParseRights(unix.UnixRights(7, 8, 9))
	if err != nil || len(fds) != 3 || fds[2] != 9 {
		t.Errorf("three descriptors: %v, %v", fds, err)
	}
}

// FuzzParseRights: arbitrary ancillary bytes never panic; the parser
// returns descriptor numbers without closing anything, or a typed error.
func FuzzParseRights(f *testing.F) {
	f.Add(unix.UnixRights(3))
	f.Add(unix.UnixRights(3, 4, 5))
	f.Add([]byte{})
	f.Add([]byte{1, 2, 3})
	f.Add(unix.UnixRights(7)[:12])
	f.Add(rightsWithDataLen(5))
	f.Add(append(unix.UnixRights(3), rightsWithDataLen(6)...))
	f.Fuzz(func(t *testing.T, oob []byte) {
		if _, err := ParseRights(oob); err != nil && !errors.Is(err, ErrControlMalformed) {
			t.Fatalf("untyped error %v", err)
		}
	})
}

func seqpacketPair(tb testing.TB) (*net.UnixConn, *net.UnixConn) {
	tb.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		tb.Fatal(err)
	}
	conns := make([]*net.UnixConn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "seqpacket")
		c, err := net.FileConn(f)
		_ = f.Close()
		if err != nil {
			tb.Fatal(err)
		}
		conns[i] = c.(*net.UnixConn)
		tb.Cleanup(func() { _ = c.Close() })
	}
	return conns[0], conns[1]
}

// FuzzDecodeDatagramFromSocket sends the input through a real SEQPACKET
// socket: up to MaxDatagram bytes arrive whole, anything longer is
// rejected as oversized (MSG_TRUNC), never decoded from its prefix, and
// the response decoder then sees exactly the bytes sent.
func FuzzDecodeDatagramFromSocket(f *testing.F) {
	for _, s := range responseSeeds(f) {
		f.Add(s)
	}
	f.Add(bytes.Repeat([]byte{0x0a, 0x00}, MaxDatagram/2))
	f.Add(append(bytes.Repeat([]byte{0x0a, 0x00}, MaxDatagram/2), 0x0a))
	a, b := seqpacketPair(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 8*MaxDatagram {
			return
		}
		if err := SendRaw(a, data); err != nil {
			t.Fatal(err)
		}
		got, fds, err := Recv(b)
		if len(fds) != 0 {
			t.Fatalf("%d descriptors from nowhere", len(fds))
		}
		switch {
		case len(data) == 0:
			if !errors.Is(err, io.EOF) {
				t.Fatalf("empty datagram: %v", err)
			}
			return
		case len(data) > MaxDatagram:
			if !errors.Is(err, ErrOversized) {
				t.Fatalf("%d-byte datagram: %v", len(data), err)
			}
			return
		case err != nil:
			t.Fatalf("%d-byte datagram: %v", len(data), err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("got %x, sent %x", got, data)
		}
		want, werr := DecodeResponse(data)
		ack, err := DecodeResponse(got)
		if (err == nil) != (werr == nil) || ack.GetError() != want.GetError() {
			t.Fatalf("decode mismatch: %v vs %v", err, werr)
		}
	})
}

// TestRecvClosesDescriptorsOnBadDatagram: descriptors that arrive with an
// oversized datagram are closed by Recv, not leaked.
func TestRecvClosesDescriptorsOnBadDatagram(t *testing.T) {
	a, b := seqpacketPair(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if err := SendRaw(a, bytes.Repeat([]byte{1}, MaxDatagram+1), int(w.Fd())); err != nil {
		t.Fatal(err)
	}
	_ = w.Close() // the only write end left is the one in flight
	if _, _, err := Recv(b); !errors.Is(err, ErrOversized) {
		t.Fatalf("Recv: %v", err)
	}
	// With every write end closed, the read end sees EOF at once.
	buf := make([]byte, 1)
	if n, err := r.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("pipe read %d, %v: a received write end is still open", n, err)
	}
}
