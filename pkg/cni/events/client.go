// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package events

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
)

// Errors returned by Client, so the plugin can tell the runtime which of the
// fail-closed cases it hit.
var (
	// ErrAgentUnreachable: nothing answered on the socket.
	ErrAgentUnreachable = errors.New("agent unreachable")
	// ErrAgentTimeout: the agent did not answer before the deadline.
	ErrAgentTimeout = errors.New("agent timed out")
	// ErrNotEnrolled: the agent answered that it could not enroll the pod.
	ErrNotEnrolled = errors.New("agent could not enroll the pod")
)

// Client is the plugin's end of the channel.
type Client struct {
	conn *grpc.ClientConn
	rpc  cniv1.CNIEventsClient
}

// NewClient prepares a client for the agent socket at socketPath. It does
// not connect; the first call does.
func NewClient(socketPath string) (*Client, error) {
	conn, err := grpc.NewClient("unix://"+socketPath, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("agent client for %s: %w", socketPath, err)
	}
	return &Client{conn: conn, rpc: cniv1.NewCNIEventsClient(conn)}, nil
}

// Close releases the connection.
func (c *Client) Close() error { return c.conn.Close() }

// PodAdd asks the agent to enroll the pod. Errors wrap ErrAgentUnreachable,
// ErrAgentTimeout or ErrNotEnrolled (and ErrNoZtunnel when that was why).
func (c *Client) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	resp, err := c.rpc.PodAdd(ctx, req)
	if err != nil {
		return nil, classify(ctx, err)
	}
	return resp, nil
}

// PodDel tells the agent the pod's sandbox is gone. Errors are classified
// as for PodAdd.
func (c *Client) PodDel(ctx context.Context, req *cniv1.PodDelRequest) error {
	if _, err := c.rpc.PodDel(ctx, req); err != nil {
		return classify(ctx, err)
	}
	return nil
}

// Probe asks the agent at socketPath whether it serves, through the gRPC
// health service, and waits no longer than ctx allows. Accepting the
// connection is not enough: an agent that accepts but never answers is
// reported as ErrAgentTimeout, a missing or refusing one as
// ErrAgentUnreachable, and one that answers but does not serve (it is
// stopping) as ErrAgentUnreachable too.
func Probe(ctx context.Context, socketPath string) error {
	c, err := NewClient(socketPath)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrAgentUnreachable, err)
	}
	defer c.Close()
	resp, err := healthpb.NewHealthClient(c.conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		return classify(ctx, err)
	}
	if st := resp.GetStatus(); st != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("%w: agent reports %s", ErrAgentUnreachable, st)
	}
	return nil
}

func classify(ctx context.Context, err error) error {
	st, _ := status.FromError(err)
	switch st.Code() {
	case codes.Unavailable:
		return fmt.Errorf("%w: %s", ErrAgentUnreachable, st.Message())
	case codes.DeadlineExceeded:
		return fmt.Errorf("%w: %s", ErrAgentTimeout, st.Message())
	case codes.Canceled:
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("%w: %s", ErrAgentTimeout, st.Message())
		}
		return fmt.Errorf("%w: %s", ErrAgentUnreachable, st.Message())
	case codes.FailedPrecondition:
		return fmt.Errorf("%w: %w: %s", ErrNotEnrolled, ErrNoZtunnel, st.Message())
	}
	return fmt.Errorf("%w: %s", ErrNotEnrolled, st.Message())
}
