// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package events

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
)

// Errors returned by Client, so the plugin can tell the runtime which of the
// fail-closed cases it hit.
var (
	// ErrAgentUnreachable: nothing answered on the socket (or nothing that
	// speaks this wire format, such as an agent of another release).
	ErrAgentUnreachable = errors.New("agent unreachable")
	// ErrAgentTimeout: the agent did not answer before the deadline.
	ErrAgentTimeout = errors.New("agent timed out")
	// ErrNotEnrolled: the agent answered that it could not enroll the pod.
	ErrNotEnrolled = errors.New("agent could not enroll the pod")
)

// Client is the plugin's end of the channel: each call dials the socket,
// writes one request and reads its answer within the call's context.
type Client struct {
	path string
}

// NewClient prepares a client for the agent socket at socketPath. It does
// not connect; each call does.
func NewClient(socketPath string) (*Client, error) {
	if socketPath == "" {
		return nil, errors.New("agent client: no socket path")
	}
	return &Client{path: socketPath}, nil
}

// Close releases nothing: calls close their connections.
func (c *Client) Close() error { return nil }

// PodAdd asks the agent to enroll the pod. Errors wrap ErrAgentUnreachable,
// ErrAgentTimeout or ErrNotEnrolled (and ErrNoZtunnel when that was why).
func (c *Client) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	var resp cniv1.PodAddResponse
	if err := c.call(ctx, cniv1.KindAdd, &cniv1.Request{Pod: req.GetPod(), Ips: req.GetIps()}, &resp); err != nil {
		return nil, err
	}
	return &resp, nil
}

// PodDel tells the agent the pod's sandbox is gone. Errors are classified
// as for PodAdd.
func (c *Client) PodDel(ctx context.Context, req *cniv1.PodDelRequest) error {
	return c.call(ctx, cniv1.KindDel, &cniv1.Request{Pod: req.GetPod()}, nil)
}

// Probe asks the agent at socketPath whether it serves, and waits no
// longer than ctx allows. Accepting the connection is not enough: an agent
// that accepts but never answers is reported as ErrAgentTimeout, a missing
// or refusing one as ErrAgentUnreachable, and one that answers but does
// not serve (it is stopping) as ErrAgentUnreachable too.
func Probe(ctx context.Context, socketPath string) error {
	c, err := NewClient(socketPath)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrAgentUnreachable, err)
	}
	return c.call(ctx, cniv1.KindProbe, &cniv1.Request{}, nil)
}

// call sends req as a frame of kind and decodes the result into resp (nil:
// an empty result), all within ctx: its deadline bounds every step and
// travels with the request, and its end interrupts the call.
func (c *Client) call(ctx context.Context, kind cniv1.Kind, req *cniv1.Request, resp any) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.path)
	if err != nil {
		return classifyIO(ctx, err)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
		req.TimeoutMillis = max(time.Until(dl).Milliseconds(), 1)
	}
	interrupt := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer interrupt()
	if err := cniv1.WriteFrame(conn, kind, req); err != nil {
		return classifyIO(ctx, err)
	}
	err = cniv1.ReadAnswer(conn, resp)
	if e, ok := errors.AsType[*cniv1.Error](err); ok {
		return classifyAnswer(ctx, e)
	}
	if err != nil {
		return classifyIO(ctx, fmt.Errorf("read the answer of the agent at %s: %w", c.path, err))
	}
	return nil
}

// classifyIO is a failure to exchange frames: a timeout when ctx's
// deadline passed, otherwise the agent is unreachable (not there, hung up
// without answering, not speaking this format, or ctx was cancelled).
func classifyIO(ctx context.Context, err error) error {
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
	case ctx.Err() != nil, !errors.Is(err, os.ErrDeadlineExceeded):
		// Cancelled, or an error of the socket's own.
		return fmt.Errorf("%w: %w", ErrAgentUnreachable, err)
	}
	return fmt.Errorf("%w: %w", ErrAgentTimeout, err)
}

// classifyAnswer is the agent's error answer as one of the Client errors.
func classifyAnswer(ctx context.Context, e *cniv1.Error) error {
	switch e.Code {
	case cniv1.CodeUnavailable, cniv1.CodeUnsupportedVersion:
		return fmt.Errorf("%w: %s", ErrAgentUnreachable, e.Message)
	case cniv1.CodeDeadlineExceeded:
		return fmt.Errorf("%w: %s", ErrAgentTimeout, e.Message)
	case cniv1.CodeCanceled:
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("%w: %s", ErrAgentTimeout, e.Message)
		}
		return fmt.Errorf("%w: %s", ErrAgentUnreachable, e.Message)
	case cniv1.CodeNoZtunnel:
		return fmt.Errorf("%w: %w: %s", ErrNotEnrolled, ErrNoZtunnel, e.Message)
	}
	return fmt.Errorf("%w: %s", ErrNotEnrolled, e.Message)
}
