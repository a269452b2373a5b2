// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
)

// tracer is someone tracing the node (issue 18): `ambient-ebpf trace -o
// json`, the CLI's own command run in a process of its own in the node
// netns, through the agent's inspection API as the CLI goes by default.
// The agent reads the ring buffer and streams each event; the command
// decodes and prints it as JSON into a counter instead of a terminal.
type tracer struct {
	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan error
	lines  lineCounter
	errOut bytes.Buffer
}

type tracerRequest struct {
	Op      string `json:"op"` // start, stop
	BPFFS   string `json:"bpffs,omitempty"`
	Inspect string `json:"inspect,omitempty"` // the agent's inspection socket
}

// tracerResult is what one trace saw: the events printed and the
// command's own summary ("N events, M lost").
type tracerResult struct {
	Events  int64  `json:"events"`
	Summary string `json:"summary"`
}

// lineCounter counts the lines written to it.
type lineCounter struct{ n atomic.Int64 }

func (l *lineCounter) Write(p []byte) (int, error) {
	l.n.Add(int64(bytes.Count(p, []byte{'\n'})))
	return len(p), nil
}

func (t *tracer) handle(line []byte) (any, error) {
	req, err := decode[tracerRequest](line)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch req.Op {
	case "start":
		if t.cancel != nil {
			return nil, errors.New("already tracing")
		}
		t.lines.n.Store(0)
		t.errOut.Reset()
		cmd := cli.NewCommand(&t.lines)
		cmd.SetErr(&t.errOut)
		cmd.SetArgs([]string{"--bpffs", req.BPFFS, "--inspect-socket", req.Inspect, "-o", "json", "trace"})
		var ctx context.Context
		ctx, t.cancel = context.WithCancel(context.Background())
		t.done = make(chan error, 1)
		go func() { t.done <- cmd.ExecuteContext(ctx) }()
		return nil, nil
	case "stop":
		if t.cancel == nil {
			return nil, errors.New("not tracing")
		}
		t.cancel()
		err := <-t.done
		t.cancel = nil
		if err != nil {
			return nil, fmt.Errorf("ambient-ebpf trace: %w: %s", err, t.errOut.String())
		}
		return tracerResult{Events: t.lines.n.Load(), Summary: strings.TrimSpace(t.errOut.String())}, nil
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

func (t *tracer) close() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.cancel != nil {
		t.cancel()
		<-t.done
	}
}
