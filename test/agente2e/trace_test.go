// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// While the agent runs, trace clients share the data path's one event
// reader through its inspection API: `ambient-ebpf trace` (which goes
// through the agent by default) and a plain gRPC client both see an
// outbound capture, a direct reader of the pins is refused meanwhile, an
// unknown pod is refused, the agent's Prometheus counters count the same
// decisions, and the events go off when the last client leaves.
func TestAgentSharesTracesAndCountsDecisions(t *testing.T) {
	n := newAgentNode(t, "app")
	a := n.pods["app"]
	n.StartReadyAgent(t, "--uninstall-on-exit")
	n.StartZtunnelFor(n.ZDS)
	n.WaitZtunnel(t)
	if resp, err := n.podAdd(t, a); err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}
	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	app := n.StartApp(a)
	socket := n.Inspect
	base := []string{"--bpffs", n.BPFFSDir, "--inspect-socket", socket}

	// Client 1: the CLI, through the agent, one pod's events as JSON.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	cliDone := make(chan error, 1)
	var cliErr bytes.Buffer
	cmd := cli.NewCommand(pw)
	cmd.SetErr(&cliErr)
	cmd.SetArgs(append(base, "-o", "json", "trace", "--pod", "default/app"))
	go func() { cliDone <- cmd.ExecuteContext(ctx); pw.Close() }()
	cliEvents := make(chan inspect.Event, 256)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			var e inspect.Event
			if json.Unmarshal(sc.Bytes(), &e) == nil {
				cliEvents <- e
			}
		}
	}()
	// Client 2: the API itself.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := inspectv1.NewInspectClient(conn).Trace(ctx, &inspectv1.TraceRequest{})
	if err != nil {
		t.Fatal(err)
	}
	apiEvents := make(chan *inspectv1.TraceEvent, 256)
	go func() {
		for {
			e, err := stream.Recv()
			if err != nil {
				return
			}
			apiEvents <- e
		}
	}()

	dst := netip.AddrPortFrom(simnode.OutsideV4, 8080)
	var sawCLI, sawAPI bool
	dials := 0
	deadline := time.Now().Add(20 * time.Second)
	for !sawCLI || !sawAPI {
		if time.Now().After(deadline) {
			t.Fatalf("no outbound capture traced (cli %v, api %v); cli stderr: %s", sawCLI, sawAPI, cliErr.String())
		}
		if _, err := app.Dial("tcp", simnode.AppRequest{Addr: dst}); err != nil {
			t.Fatalf("dial: %v", err)
		}
		dials++
		wait := time.After(300 * time.Millisecond)
	drain:
		for {
			select {
			case e := <-cliEvents:
				if e.Pod != "default/app" {
					t.Errorf("--pod default/app printed another pod's event: %+v", e)
				}
				sawCLI = sawCLI || e.Reason == inspect.ReasonOutbound && e.Dst == dst && e.To == netip.AddrPortFrom(a.V4, 15001) && e.Row == "R1"
			case e := <-apiEvents:
				sawAPI = sawAPI || e.Pod == "default/app" && e.Hook == "connect4" && e.Decision == "captured" && e.Reason == "outbound" &&
					e.Dst == dst.String() && e.RedirectedTo == netip.AddrPortFrom(a.V4, 15001).String() && e.TimeUnixNano > 0
			case <-wait:
				break drain
			}
		}
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"trace", "--pins"}, "another tracer is reading this data path's events"},
		{[]string{"trace", "--pod", "default/nope"}, "trace through the agent: pod default/nope: no such pod is enrolled on this node"},
		{[]string{"trace", "--since", "1m"}, "trace through the agent: the agent keeps no trace history: start it with --trace-history"},
		{[]string{"trace", "--pins", "--since", "1m"}, "--since replays the agent's trace history; the pins hold no past events"},
	} {
		var b bytes.Buffer
		cmd := cli.NewCommand(&b)
		cmd.SetErr(io.Discard)
		cmd.SetArgs(append(append([]string{}, base...), c.args...))
		if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("ambient-ebpf %s: %v, want %q", strings.Join(c.args, " "), err, c.want)
		}
	}

	_, metrics := n.Get("/metrics")
	re := regexp.MustCompile(`ambient_ebpf_decisions_total\{decision="captured",reason="outbound",row="R1"\} (\d+)`)
	if m := re.FindStringSubmatch(metrics); m == nil {
		t.Errorf("metrics lack the outbound decisions:\n%s", metrics)
	} else if count, _ := strconv.Atoi(m[1]); count < dials {
		t.Errorf("%d outbound decisions counted, want one for each of the %d connections traced", count, dials)
	}
	for _, want := range []string{`ambient_ebpf_decisions_total{decision="captured",reason="inbound",row="R5"} 0`, "ambient_ebpf_trace_lost_events_total 0"} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}

	// Both clients leave: the agent switches the events off and lets go
	// of the reader.
	cancel()
	if err := <-cliDone; err != nil {
		t.Errorf("trace through the agent: %v", err)
	}
	testenv.Eventually(t, time.Minute, "the agent to let go of the trace", func() bool {
		tr, err := inspect.OpenTracer(n.BPFFSDir)
		if err == nil {
			tr.Close()
			return true
		}
		return !errors.Is(err, inspect.ErrTraceBusy)
	})
}

// An agent started with --trace-history traces from the start and keeps
// the window: `trace --since` first replays a capture made while nobody
// traced, then streams live; the history stops at the window.
func TestTraceSinceReplaysTheAgentsHistory(t *testing.T) {
	n := newAgentNode(t, "app")
	a := n.pods["app"]
	n.StartReadyAgent(t, "--uninstall-on-exit", "--trace-history=1m")
	n.StartZtunnelFor(n.ZDS)
	n.WaitZtunnel(t)
	if resp, err := n.podAdd(t, a); err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD: %+v, %v", resp, err)
	}
	out := n.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	app := n.StartApp(a)
	base := []string{"--bpffs", n.BPFFSDir, "--inspect-socket", n.Inspect}
	dst := netip.AddrPortFrom(simnode.OutsideV4, 8080)

	// The agent holds the reader from the start, with no client.
	testenv.Eventually(t, time.Minute, "the agent to trace for its history", func() bool {
		tr, err := inspect.OpenTracer(n.BPFFSDir)
		if err == nil {
			tr.Close()
		}
		return errors.Is(err, inspect.ErrTraceBusy)
	})
	dialed := time.Now()
	if _, err := app.Dial("tcp", simnode.AppRequest{Addr: dst}); err != nil {
		t.Fatalf("dial: %v", err)
	}
	time.Sleep(200 * time.Millisecond) // the agent reads the ring in the background

	run := func(args ...string) (events []inspect.Event, err error) {
		var b bytes.Buffer
		cmd := cli.NewCommand(&b)
		cmd.SetErr(io.Discard)
		cmd.SetArgs(append(append([]string{}, base...), args...))
		err = cmd.Execute()
		for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
			var e inspect.Event
			if line != "" && json.Unmarshal([]byte(line), &e) == nil {
				events = append(events, e)
			}
		}
		return events, err
	}
	captured := func(e inspect.Event) bool {
		return e.Pod == "default/app" && e.Reason == inspect.ReasonOutbound && e.Dst == dst && e.To == netip.AddrPortFrom(a.V4, 15001)
	}
	events, err := run("-o", "json", "trace", "--since", "1m", "--pod", "default/app", "--duration", "2s")
	if err != nil {
		t.Fatalf("trace --since 1m: %v", err)
	}
	var replayed bool
	for _, e := range events {
		if e.Pod != "default/app" {
			t.Errorf("--pod default/app replayed another pod's event: %+v", e)
		}
		replayed = replayed || captured(e) && !e.Time.Before(dialed.Add(-time.Second)) && e.Time.Before(time.Now())
	}
	if !replayed {
		t.Fatalf("trace --since 1m did not replay the capture made before it started: %+v", events)
	}
	// A window that ends after the dial holds none of it.
	time.Sleep(1500 * time.Millisecond)
	events, err = run("-o", "json", "trace", "--since", "1s", "--pod", "default/app", "--duration", "1s")
	if err != nil {
		t.Fatalf("trace --since 1s: %v", err)
	}
	for _, e := range events {
		if captured(e) {
			t.Errorf("trace --since 1s replayed an event from before the window: %+v", e)
		}
	}
}
