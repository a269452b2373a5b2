// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
)

// The CNI channel of the releases before pkg/api/cniv1's frames (v0.1.0):
// the gRPC service ambientebpf.cni.v1.CNIEvents on the same socket. The
// upgrade tests ask an agent of such a release as its own plugin did;
// nothing shipped speaks it any more. Its messages are encoded here by
// hand (the protobuf field numbers of that release's cni.proto).
const grpcCNIService = "/ambientebpf.cni.v1.CNIEvents/"

// rawCodec passes already encoded protobuf messages through gRPC.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }

func (rawCodec) Unmarshal(data []byte, v any) error {
	*v.(*[]byte) = append([]byte(nil), data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

// grpcCNICall calls method of the old service at socket with the encoded
// request and returns the encoded response.
func grpcCNICall(ctx context.Context, socket, method string, req []byte) ([]byte, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("grpc client for %s: %w", socket, err)
	}
	defer conn.Close()
	var resp []byte
	if err := conn.Invoke(ctx, grpcCNIService+method, &req, &resp, grpc.ForceCodec(rawCodec{})); err != nil {
		return nil, fmt.Errorf("%s on %s: %w", method, socket, err)
	}
	return resp, nil
}

// grpcCNIPod encodes a Pod message: name 1, namespace 2, uid 3,
// container_id 4, netns 5, interface 6.
func grpcCNIPod(p *cniv1.Pod) []byte {
	var b []byte
	for i, s := range []string{p.GetName(), p.GetNamespace(), p.GetUid(), p.GetContainerId(), p.GetNetns(), p.GetInterface()} {
		if s != "" {
			b = protowire.AppendTag(b, protowire.Number(i+1), protowire.BytesType)
			b = protowire.AppendString(b, s)
		}
	}
	return b
}

// grpcCNIPodAdd is PodAdd of the old service: PodAddRequest {pod 1, ips 2},
// PodAddResponse {enrolled 1, reason 2}.
func grpcCNIPodAdd(ctx context.Context, socket string, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, grpcCNIPod(req.GetPod()))
	for _, ip := range req.GetIps() {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, ip)
	}
	out, err := grpcCNICall(ctx, socket, "PodAdd", b)
	if err != nil {
		return nil, err
	}
	var resp cniv1.PodAddResponse
	for len(out) > 0 {
		num, typ, n := protowire.ConsumeTag(out)
		if n < 0 {
			return nil, errors.New("PodAddResponse: bad tag")
		}
		out = out[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, m := protowire.ConsumeVarint(out)
			resp.Enrolled, n = v != 0, m
		case num == 2 && typ == protowire.BytesType:
			resp.Reason, n = protowire.ConsumeString(out)
		default:
			n = protowire.ConsumeFieldValue(num, typ, out)
		}
		if n < 0 {
			return nil, fmt.Errorf("PodAddResponse: bad field %d", num)
		}
		out = out[n:]
	}
	return &resp, nil
}

// grpcCNIPodDel is PodDel of the old service: PodDelRequest {pod 1}.
func grpcCNIPodDel(ctx context.Context, socket string, req *cniv1.PodDelRequest) error {
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, grpcCNIPod(req.GetPod()))
	_, err := grpcCNICall(ctx, socket, "PodDel", b)
	return err
}
