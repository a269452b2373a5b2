// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

// traceOptions are trace's own flags.
type traceOptions struct {
	pod      string
	count    int
	duration time.Duration
	since    time.Duration // replay the agent's history from this long ago
	pins     bool          // read the pins even when the agent answers
}

func traceCommand(o *options) *cobra.Command {
	var to traceOptions
	cmd := &cobra.Command{
		Use:   "trace",
		Short: "Stream the data path's decisions as they happen (works without the agent)",
		Long: `trace streams each decision the BPF programs make: time, pod, hook, protocol,
source and original destination, decision, reason and contract row, and where a
captured connection went. The programs emit events only while someone traces.

While the agent runs, the events come through its inspection API, which any
number of clients share; without it (or with --pins) trace reads the pins
itself, one tracer at a time.

--since first replays what the agent saw in that window, then streams live.
The programs emit events only while someone traces, so a past exists only
where the agent keeps one: started with --trace-history (chart:
agent.traceHistory), it traces all the time and remembers that long.`,
		Example: `  ambient-ebpf trace
  ambient-ebpf trace --pod shop/web -o json
  ambient-ebpf trace --count 10 --duration 30s
  ambient-ebpf trace --since 5m --pod shop/web`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runTrace(cmd.Context(), o, to, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	f := cmd.Flags()
	f.StringVar(&to.pod, "pod", "", "only this pod's decisions (NAMESPACE/NAME)")
	f.IntVar(&to.count, "count", 0, "stop after this many events (0: until interrupted)")
	f.DurationVar(&to.duration, "duration", 0, "stop after this long (0: until interrupted)")
	f.DurationVar(&to.since, "since", 0, "first replay the decisions of this last window from the agent's history (needs the agent's --trace-history)")
	f.BoolVar(&to.pins, "pins", false, "read the pinned ring buffer directly, even when the agent answers")
	return cmd
}

// eventSource yields events until it is closed (then an error wrapping
// os.ErrClosed).
type eventSource interface {
	Read() (inspect.Event, error)
	Lost() uint64
	Close() error
}

func runTrace(ctx context.Context, o *options, to traceOptions, out, errOut io.Writer) error {
	if to.since < 0 {
		return fmt.Errorf("--since %s: want a positive duration", to.since)
	}
	if to.since > 0 && to.pins {
		return errSinceNeedsAgent
	}
	if to.duration > 0 {
		// A cancel, not a deadline: a deadline travels to the agent,
		// whose side may then end the stream first, as a reset.
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		t := time.AfterFunc(to.duration, cancel)
		defer t.Stop()
	}
	src, err := openEvents(ctx, o, to, errOut)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { _ = src.Close() })
	defer stop()
	p := newEventPrinter(o.output, out)
	n := 0
	for to.count == 0 || n < to.count {
		e, err := src.Read()
		if errors.Is(err, os.ErrClosed) {
			break
		}
		if err != nil {
			src.Close()
			return err
		}
		if to.pod != "" && e.Pod != to.pod {
			continue
		}
		if err := p.print(e); err != nil {
			src.Close()
			return err
		}
		n++
	}
	lost := src.Lost()
	if err := src.Close(); err != nil {
		return err
	}
	fmt.Fprintf(errOut, "%d events, %d lost\n", n, lost)
	return nil
}

// openEvents streams from the agent when it answers, else from the pins.
func openEvents(ctx context.Context, o *options, to traceOptions, errOut io.Writer) (eventSource, error) {
	if !to.pins {
		var since time.Time
		if to.since > 0 {
			since = time.Now().Add(-to.since)
		}
		s, err := agentEvents(ctx, o.agent.inspectSocket, to.pod, since)
		if err == nil {
			return s, nil
		}
		if !errors.Is(err, errAgentDown) {
			return nil, err
		}
		if to.since > 0 {
			return nil, fmt.Errorf("%w on %s: %w", errAgentDown, o.agent.inspectSocket, errSinceNeedsAgent)
		}
		fmt.Fprintf(errOut, "the agent does not answer on %s: reading the pins\n", o.agent.inspectSocket)
	}
	if to.pod != "" {
		if err := requirePod(o, to.pod); err != nil {
			return nil, err
		}
	}
	t, err := inspect.OpenTracer(o.bpffs)
	switch {
	case errors.Is(err, inspect.ErrNotInstalled):
		return nil, fmt.Errorf("%w (is the agent installed on this node? see --bpffs)", err)
	case errors.Is(err, inspect.ErrTraceBusy):
		return nil, fmt.Errorf("%w: is another `ambient-ebpf trace --pins` running, or the agent tracing for its clients?", err)
	}
	return t, err
}

// errSinceNeedsAgent refuses --since where only the pins are read: they
// hold no past events.
var errSinceNeedsAgent = errors.New("--since replays the agent's trace history; the pins hold no past events (the programs emit events only while someone traces)")

// requirePod fails for a pod that is not enrolled on this node.
func requirePod(o *options, name string) error {
	p, err := o.open()
	if err != nil {
		return err
	}
	defer p.Close()
	pods, err := p.Pods()
	if err != nil {
		return err
	}
	if !slices.ContainsFunc(pods, func(e inspect.EnrolledPod) bool { return e.Namespace+"/"+e.Name == name }) {
		return fmt.Errorf("pod %s: %w (ambient-ebpf pods lists them)", name, inspect.ErrUnknownPod)
	}
	return nil
}

// eventPrinter writes events as they come: aligned lines, or one JSON
// object per line.
type eventPrinter struct {
	json   bool
	out    io.Writer
	enc    *json.Encoder
	header bool
}

func newEventPrinter(output string, out io.Writer) *eventPrinter {
	return &eventPrinter{json: output == "json", out: out, enc: json.NewEncoder(out)}
}

const eventFormat = "%-15s  %-14s  %-11s  %-5s  %-24s  %-24s  %-10s  %-17s  %-4s  %s\n"

func (p *eventPrinter) print(e inspect.Event) error {
	if p.json {
		return p.enc.Encode(e)
	}
	if !p.header {
		p.header = true
		if _, err := fmt.Fprintf(p.out, eventFormat, "TIME", "POD", "HOOK", "PROTO", "SOURCE", "DESTINATION", "DECISION", "REASON", "ROW", "TO"); err != nil {
			return err
		}
	}
	pod := e.Pod
	if pod == "" {
		pod = "-"
		if e.NetnsCookie != 0 {
			pod = fmt.Sprintf("netns:%d", e.NetnsCookie)
		}
	}
	to := ""
	if e.To.IsValid() {
		to = "-> " + endpoint(e.To, false)
	}
	_, err := fmt.Fprintf(p.out, eventFormat, e.Time.Format("15:04:05.000000"), pod, e.Hook, e.Proto,
		endpoint(e.Src, false), endpoint(e.Dst, false), e.Decision, e.Reason, e.Row, strings.TrimSpace(to))
	return err
}
