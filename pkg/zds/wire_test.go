// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package zds

import (
	"bytes"
	"context"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"istio.io/istio/pkg/zdsapi"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
)

// field is one top-level protobuf field as it sits on the wire.
type field struct {
	num protowire.Number
	typ protowire.Type
	val []byte // bytes for LEN fields
	u   uint64 // value for VARINT fields
}

// parseFields splits b into its top-level fields without any schema, so the
// field numbers checked below are the bytes on the wire, not what a
// generated type makes of them.
func parseFields(t *testing.T, b []byte) []field {
	t.Helper()
	var out []field
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatalf("bad tag in %x", b)
		}
		b = b[n:]
		f := field{num: num, typ: typ}
		switch typ {
		case protowire.BytesType:
			f.val, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			f.u, n = protowire.ConsumeVarint(b)
		default:
			t.Fatalf("unexpected wire type %v", typ)
		}
		if n < 0 {
			t.Fatalf("bad value in %x", b)
		}
		b = b[n:]
		out = append(out, f)
	}
	return out
}

// only returns the single field of b and fails on anything else.
func only(t *testing.T, b []byte, num protowire.Number) field {
	t.Helper()
	fs := parseFields(t, b)
	if len(fs) != 1 || fs[0].num != num || fs[0].typ != protowire.BytesType {
		t.Fatalf("want exactly field %d (LEN) in %x, got %+v", num, b, fs)
	}
	return fs[0]
}

// TestZ1Z2Z3Z5WireMatchesIstioTypes drives the server with bytes encoded by
// Istio's published zdsapi types and decodes every byte it sends with them,
// checking field numbers on the wire against the contract, the SCM_RIGHTS
// count, and that the descriptor is the pod's netns by (dev, inode).
func TestZ1Z2Z3Z5WireMatchesIstioTypes(t *testing.T) {
	nsA := nstest.NewNetns(t)
	nsLive := nstest.NewNetns(t)
	h := startServer(t, Config{Snapshot: func() []Workload {
		return []Workload{
			{UID: "uid-a", Name: "a", Namespace: "ns1", ServiceAccount: "sa-a", Netns: nsA},
			{UID: "uid-b", Name: "b", Namespace: "ns1", ServiceAccount: "sa-b"}, // netns unknown
		}
	}})
	p := dialRaw(t, h.path)

	// Z1: ZdsHello{version=V1} is field 1 varint 1 on the wire.
	hello, err := proto.Marshal(&zdsapi.ZdsHello{Version: zdsapi.Version_V1})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(hello, []byte{0x08, 0x01}) {
		t.Fatalf("hello encodes as %x, contract says field 1 = 1", hello)
	}
	p.sendBytes(hello)

	// Z2, Z5: AddWorkload = WorkloadRequest field 1, with one fd for nsA.
	req, d := p.recv()
	if len(d.fds) != 1 {
		t.Fatalf("add carried %d fds, want exactly 1", len(d.fds))
	}
	if got, want := nstest.IdentOfFD(t, d.fds[0]), nstest.IdentOfPath(t, nsA); got != want {
		t.Fatalf("add fd is %+v, want netns %s %+v", got, nsA, want)
	}
	add := only(t, d.data, 1)
	addFields := parseFields(t, add.val)
	if len(addFields) != 2 || addFields[0].num != 1 || string(addFields[0].val) != "uid-a" || addFields[1].num != 2 {
		t.Fatalf("AddWorkload fields %+v, want uid (1) and workload_info (2)", addFields)
	}
	info := parseFields(t, addFields[1].val)
	wantInfo := []string{1: "a", 2: "ns1", 3: "sa-a"}
	if len(info) != 3 {
		t.Fatalf("WorkloadInfo fields %+v, want name, namespace, service_account", info)
	}
	for _, f := range info {
		if int(f.num) >= len(wantInfo) || string(f.val) != wantInfo[f.num] {
			t.Fatalf("WorkloadInfo field %d = %q, want %q", f.num, f.val, wantInfo)
		}
	}
	if got := req.GetAdd(); got.GetUid() != "uid-a" || got.GetWorkloadInfo().GetServiceAccount() != "sa-a" {
		t.Fatalf("zdsapi decodes add as %v", req)
	}
	// Ack{} inside WorkloadResponse field 1.
	ack, err := proto.Marshal(&zdsapi.WorkloadResponse{Payload: &zdsapi.WorkloadResponse_Ack{Ack: &zdsapi.Ack{}}})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ack, []byte{0x0a, 0x00}) {
		t.Fatalf("empty ack encodes as %x", ack)
	}
	p.sendBytes(ack)

	// Z2: KeepWorkload = field 5, uid field 1, and no fd.
	req, d = p.recv()
	if len(d.fds) != 0 {
		t.Fatalf("keep carried %d fds", len(d.fds))
	}
	keep := only(t, d.data, 5)
	if kf := only(t, keep.val, 1); string(kf.val) != "uid-b" {
		t.Fatalf("keep uid %q", kf.val)
	}
	if req.GetKeep().GetUid() != "uid-b" {
		t.Fatalf("zdsapi decodes keep as %v", req)
	}
	p.sendBytes(ack)

	// Z3: SnapshotSent = field 3, empty.
	req, d = p.recv()
	if !bytes.Equal(d.data, []byte{0x1a, 0x00}) || len(d.fds) != 0 || req.GetSnapshotSent() == nil {
		t.Fatalf("snapshot_sent is %x with %d fds", d.data, len(d.fds))
	}
	p.sendBytes(ack)

	// Z4, Z5: a live add carries the live pod's netns.
	ctx := context.Background()
	done := doAsync(func() error {
		return h.srv.AddWorkload(ctx, Workload{UID: "uid-c", Name: "c", Namespace: "ns2", ServiceAccount: "default", Netns: nsLive})
	})
	req, d = p.recv()
	if len(d.fds) != 1 || nstest.IdentOfFD(t, d.fds[0]) != nstest.IdentOfPath(t, nsLive) {
		t.Fatalf("live add: %d fds, want one for %s", len(d.fds), nsLive)
	}
	if req.GetAdd().GetWorkloadInfo().GetNamespace() != "ns2" {
		t.Fatalf("live add decodes as %v", req)
	}
	p.sendBytes(ack)
	if err := waitErr(t, done); err != nil {
		t.Fatalf("AddWorkload: %v", err)
	}

	// DelWorkload = field 2, and its uid is field 2 as well.
	done = doAsync(func() error { return h.srv.DelWorkload(ctx, "uid-c") })
	req, d = p.recv()
	del := only(t, d.data, 2)
	if uf := only(t, del.val, 2); string(uf.val) != "uid-c" || len(d.fds) != 0 {
		t.Fatalf("del %x with %d fds", d.data, len(d.fds))
	}
	if req.GetDel().GetUid() != "uid-c" {
		t.Fatalf("zdsapi decodes del as %v", req)
	}
	p.sendBytes(ack)
	if err := waitErr(t, done); err != nil {
		t.Fatalf("DelWorkload: %v", err)
	}
}
