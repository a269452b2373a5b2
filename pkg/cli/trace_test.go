// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// tracing runs `ambient-ebpf trace -o json` for the rest of the test and
// hands its events over a channel.
type tracing struct {
	events chan inspect.Event
	done   chan error
}

func startTrace(t *testing.T, bpffs string, args ...string) *tracing {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	tr := &tracing{events: make(chan inspect.Event, 4096), done: make(chan error, 1)}
	cmd := NewCommand(pw)
	cmd.SetErr(io.Discard)
	cmd.SetArgs(append([]string{"--bpffs", bpffs, "-o", "json", "trace", "--pins"}, args...))
	go func() {
		err := cmd.ExecuteContext(ctx)
		pw.Close()
		tr.done <- err
	}()
	go func() {
		defer close(tr.events)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			var e inspect.Event
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				t.Errorf("trace printed a line that is no event: %q: %v", sc.Text(), err)
				continue
			}
			tr.events <- e
		}
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-tr.done; err != nil {
			t.Errorf("trace: %v", err)
		}
	})
	return tr
}

// collect returns the events that arrive until none came for quiet.
func (tr *tracing) collect(quiet time.Duration) []inspect.Event {
	var out []inspect.Event
	for {
		select {
		case e, ok := <-tr.events:
			if !ok {
				return out
			}
			out = append(out, e)
		case <-time.After(quiet):
			return out
		}
	}
}

// decision is what trace and why must agree on: whose hook, which way,
// and what it decided why. Hooks are compared by direction: the stand-in
// may open dual-stack sockets (connect6 for IPv4 peers).
func decisionOf(pod string, hook inspect.Hook, r inspect.Reason) string {
	return fmt.Sprintf("%s %s %s/%s", pod, hook.Direction(), r.Decision(), r)
}

func decisionSet(items []string) []string {
	slices.Sort(items)
	return slices.Compact(items)
}

// Real traffic for a set of cases: the trace of each connection and the
// answer of why for it name the same decisions of the same pods' hooks
// (the trace's events of sockets in no pod, such as the outside host's in
// this simulated node, are left out). Events are checked field by field.
func TestTraceAndWhyAgreeOnRealTraffic(t *testing.T) {
	m := newMesh(t)
	n := m.n
	any6 := netip.IPv6Unspecified()
	appA, appB, appD := n.StartApp(m.a), n.StartApp(m.b), n.StartApp(m.d)
	appA.Listen("tcp", "a", netip.AddrPortFrom(any6, 8080))
	appA.Listen("tcp", "a-lo", netip.MustParseAddrPort("127.0.0.1:8081"))
	appB.Listen("tcp", "b", netip.AddrPortFrom(any6, 8080))
	appD.Listen("tcp", "d", netip.AddrPortFrom(any6, 8080))
	outside := n.StartOutsideApp()
	outside.Listen("tcp", "outside", netip.AddrPortFrom(any6, 8080))
	outside.Listen("udp", "outside-udp", netip.AddrPortFrom(any6, 9999))
	if _, err := outside.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(any6, 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		t.Fatal(err)
	}
	host := n.StartNodeApp()
	host.Listen("tcp", "node", netip.AddrPortFrom(simnode.ProbeV4, 8082))
	vm := n.StartVMApp(m.vm)

	tr := startTrace(t, n.BPFFSDir)
	// The tracer is on once a loopback connect shows up.
	if !testenv.Poll(10*time.Second, func() bool {
		if len(tr.collect(200*time.Millisecond)) > 0 {
			return true
		}
		_, _ = appA.Dial("tcp", simnode.AppRequest{Addr: netip.MustParseAddrPort("127.0.0.1:8081")})
		return false
	}) {
		t.Fatal("no trace event for a loopback connect in 10s")
	}

	out4, out6 := simnode.OutsideV4, simnode.OutsideV6
	ap := func(a netip.Addr, port uint16) netip.AddrPort { return netip.AddrPortFrom(a, port) }
	dial := func(app *simnode.App, proto string, req simnode.AppRequest) func() error {
		return func() error { _, err := app.Dial(proto, req); return err }
	}
	dns := func(app *simnode.App, name string) func() error {
		return func() error {
			_, err := app.Do(simnode.AppRequest{Op: "dns", Addr: ap(out4, 53), DNSName: name, Proto: "udp"})
			return err
		}
	}
	cases := []struct {
		name    string
		why     []string
		traffic func() error
		fails   bool // the connection must fail (dropped)
	}{
		{"R1_outbound_v4", []string{"default/a", ap(out4, 8080).String()}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(out4, 8080)}), false},
		{"R1_outbound_v6", []string{"default/a", ap(out6, 8080).String()}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(out6, 8080)}), false},
		{"R1_R5_pod_to_pod", []string{"default/a", "default/b:8080"}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(m.b.V4, 8080)}), false},
		{"R2_ztunnel_mark", []string{"--mark", "0x539", "default/a", ap(out4, 8080).String()}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(out4, 8080), Mark: 0x539}), false},
		{"R3_loopback", []string{"default/a", "127.0.0.1:8081"}, dial(appA, "tcp", simnode.AppRequest{Addr: netip.MustParseAddrPort("127.0.0.1:8081")}), false},
		{"R4_own_ip", []string{"default/a", "default/a:8080"}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(m.a.V4, 8080)}), false},
		{"R5_inbound", []string{out4.String(), "default/a:8080"}, dial(outside, "tcp", simnode.AppRequest{Addr: ap(m.a.V4, 8080)}), false},
		{"R5_inbound_v6", []string{out6.String(), "default/a:8080", "-6"}, dial(outside, "tcp", simnode.AppRequest{Addr: ap(m.a.V6, 8080)}), false},
		{"R5_no_listener_dropped", []string{out4.String(), "default/x:8080"}, dial(outside, "tcp", simnode.AppRequest{Addr: ap(m.x.V4, 8080)}), true},
		{"R6_hbone", []string{out4.String(), "default/a:15008"}, dial(outside, "tcp", simnode.AppRequest{Addr: ap(m.a.V4, 15008)}), false},
		{"R7_H1_host_probe", []string{"node", "default/a:8080"}, dial(host, "tcp", simnode.AppRequest{Addr: ap(m.a.V4, 8080)}), false},
		{"R8_probe_destination", []string{"default/a", ap(simnode.ProbeV4, 8082).String()}, dial(appA, "tcp", simnode.AppRequest{Addr: ap(simnode.ProbeV4, 8082)}), false},
		{"R9_dns", []string{"default/a", ap(out4, 53).String(), "udp"}, dns(appA, "r9."+simnode.KnownDNSSuffix), false},
		{"R11_udp", []string{"default/a", ap(out4, 9999).String(), "udp"}, dial(appA, "udp", simnode.AppRequest{Addr: ap(out4, 9999)}), false},
		{"R12_ingress_mode", []string{out4.String(), "default/d:8080"}, dial(outside, "tcp", simnode.AppRequest{Addr: ap(m.d.V4, 8080)}), false},
		{"R13_dns_capture_off", []string{"default/d", ap(out4, 53).String(), "udp"}, dns(appD, "r13."+simnode.KnownDNSSuffix), false},
		{"R14_virtual_interface", []string{"--via", "virt0", "default/e", ap(out4, 8080).String()}, dial(vm, "tcp", simnode.AppRequest{Addr: ap(out4, 8080)}), false},
	}
	traced := map[string][]inspect.Event{}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var want []string
			for _, l := range whyJSON(t, n.BPFFSDir, c.why...).Legs {
				if l.Pod != "" {
					want = append(want, decisionOf(l.Pod, l.Hook, l.Reason))
				}
			}
			tr.collect(50 * time.Millisecond) // nothing of an earlier case
			if err := c.traffic(); (err != nil) != c.fails {
				t.Fatalf("traffic: %v (should fail: %v)", err, c.fails)
			}
			events := tr.collect(300 * time.Millisecond)
			traced[c.name] = events
			var got []string
			for _, e := range events {
				if e.Pod != "" {
					got = append(got, decisionOf(e.Pod, e.Hook, e.Reason))
				}
			}
			if got, want := decisionSet(got), decisionSet(want); !slices.Equal(got, want) {
				t.Errorf("trace and why disagree\ntrace: %q\n  why: %q\nevents: %+v", got, want, events)
			}
		})
	}

	// Field by field: a's connect to b, captured, and b's sk_lookup
	// handing the flow to ztunnel.
	find := func(events []inspect.Event, pod string, r inspect.Reason) inspect.Event {
		for _, e := range events {
			if e.Pod == pod && e.Reason == r {
				return e
			}
		}
		t.Errorf("no %s event of %s in %+v", r, pod, events)
		return inspect.Event{}
	}
	ev := traced["R1_R5_pod_to_pod"]
	out := find(ev, "default/a", inspect.ReasonOutbound)
	if out.Hook != inspect.HookConnect4 || out.Proto != "tcp" || out.Dst != ap(m.b.V4, 8080) || out.To != ap(m.a.V4, 15001) ||
		out.Decision != inspect.DecisionCaptured || out.Row != "R1" || out.Src.IsValid() && out.Src.Addr() != m.a.V4 ||
		time.Since(out.Time) > time.Minute || time.Since(out.Time) < 0 {
		t.Errorf("a's outbound event: %+v", out)
	}
	sk := features.HasSkLookupIfindex() && features.HasNetnsCookieSockops()
	inHook := inspect.HookSkLookup
	if !sk {
		inHook = inspect.HookTCIngress // before 5.17
	}
	in := find(ev, "default/b", inspect.ReasonInbound)
	if in.Hook != inHook || in.Src.Addr() != m.a.V4 || in.Src.Port() == 0 || in.Dst != ap(m.b.V4, 8080) ||
		in.To != ap(m.b.V4, 15006) || in.Decision != inspect.DecisionCaptured || in.Row != "R5" || in.NetnsCookie == 0 {
		t.Errorf("b's inbound event: %+v", in)
	}
	probe := find(traced["R7_H1_host_probe"], "default/a", inspect.ReasonProbeDirect)
	if probe.Hook != inHook || probe.Decision != inspect.DecisionPassed || probe.To.IsValid() || probe.Row != "H1" ||
		probe.Src.Addr() != simnode.GatewayV4 || probe.Src.Port() == 0 || probe.Dst != ap(m.a.V4, 8080) {
		t.Errorf("the direct probe's event: %+v", probe)
	}
	re := find(traced["R14_virtual_interface"], "default/e", inspect.ReasonReroute)
	if re.Hook != inspect.HookReroute || re.Src.Addr() != m.vm.Addr || re.Dst != ap(out4, 8080) || re.To != ap(out4, 15001) || re.Row != "R14" {
		t.Errorf("the virtual interface's capture event: %+v", re)
	}
	dnsEv := find(traced["R9_dns"], "default/a", inspect.ReasonDNS)
	if dnsEv.Hook != inspect.HookSendmsg4 || dnsEv.Proto != "udp" || dnsEv.Dst != ap(out4, 53) || dnsEv.To != netip.MustParseAddrPort("127.0.0.1:15053") {
		t.Errorf("the DNS event: %+v", dnsEv)
	}

	// The counters saw the same decisions, tracing or not.
	p, err := inspect.OpenPinned(n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d, err := p.Decisions()
	if err != nil {
		t.Fatal(err)
	}
	counted := []inspect.Reason{inspect.ReasonOutbound, inspect.ReasonInbound, inspect.ReasonDNS, inspect.ReasonNoListener, inspect.ReasonReroute,
		inspect.ReasonProbeDirect, inspect.ReasonHBONE, inspect.ReasonIngressMode}
	if sk {
		// Only sk_lookup sees ztunnel's deliveries; tc on the pod's
		// interface never meets what goes over lo.
		counted = append(counted, inspect.ReasonZtunnelDelivery, inspect.ReasonFromPod)
	}
	for _, r := range counted {
		if d.ByReason[r] == 0 {
			t.Errorf("ae_decisions counted no %s decision: %+v", r, d.ByReason)
		}
	}
	if d.ByReason[inspect.ReasonForwarded] != 0 || d.Lost != 0 {
		t.Errorf("forwarded counted %d (it is traced only), %d events lost", d.ByReason[inspect.ReasonForwarded], d.Lost)
	}
}

// trace's errors: no pins, an unknown pod, a second tracer; its table.
func TestTraceErrorsAndTable(t *testing.T) {
	m := newMesh(t)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--bpffs", t.TempDir(), "trace", "--pins"}, "no ambient-ebpf data path pinned here (is the agent installed on this node? see --bpffs)"},
		{[]string{"--bpffs", m.n.BPFFSDir, "trace", "--pins", "--pod", "default/nope"}, "pod default/nope: no such pod is enrolled on this node (ambient-ebpf pods lists them)"},
		// No agent answers: trace falls back to the pins.
		{[]string{"--bpffs", t.TempDir(), "--inspect-socket", filepath.Join(t.TempDir(), "none.sock"), "trace"}, "no ambient-ebpf data path pinned here"},
	} {
		if err := fail(t, c.args...); !strings.Contains(err.Error(), c.want) {
			t.Errorf("ambient-ebpf %s: %v, want %q", strings.Join(c.args, " "), err, c.want)
		}
	}
	other, err := inspect.OpenTracer(m.n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	err = fail(t, "--bpffs", m.n.BPFFSDir, "trace", "--pins")
	if !errors.Is(err, inspect.ErrTraceBusy) || !strings.Contains(err.Error(), "is another `ambient-ebpf trace --pins` running, or the agent tracing for its clients?") {
		t.Errorf("a second tracer: %v", err)
	}
	other.Close()

	app := m.n.StartApp(m.a)
	done := make(chan string, 1)
	go func() {
		done <- run(t, "--bpffs", m.n.BPFFSDir, "trace", "--pins", "--pod", "default/a", "--count", "1", "--duration", "20s")
	}()
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, _ = app.Dial("tcp", simnode.AppRequest{Addr: netip.MustParseAddrPort("127.0.0.1:9")})
		select {
		case table := <-done:
			lines := strings.Split(strings.TrimSpace(table), "\n")
			if len(lines) != 2 || !strings.HasPrefix(lines[0], "TIME ") {
				t.Fatalf("trace --count 1 printed:\n%s", table)
			}
			f := strings.Fields(lines[1])
			want := []string{"default/a", "connect4", "tcp", "*", "127.0.0.1:9", "passed", "loopback", "R3"}
			if len(f) != 9 || !slices.Equal(f[1:], want) {
				t.Errorf("trace line %q: fields %q, want a time then %q", lines[1], f, want)
			}
			return
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("trace --count 1 printed nothing")
		}
	}
}
