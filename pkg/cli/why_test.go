// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// legString is a leg in one line: pod, hook, decision/reason and where a
// captured connection goes.
func legString(l inspect.Leg) string {
	s := fmt.Sprintf("%s %s %s/%s", l.Pod, l.Hook, l.Decision, l.Reason)
	if l.To.IsValid() {
		s += " " + endpoint(l.To, false)
	}
	return s
}

func whyJSON(t *testing.T, bpffs string, args ...string) *inspect.Answer {
	t.Helper()
	var a inspect.Answer
	out := run(t, append([]string{"--bpffs", bpffs, "-o", "json", "why"}, args...)...)
	if err := json.Unmarshal([]byte(out), &a); err != nil {
		t.Fatalf("why %s -o json: %v\n%s", strings.Join(args, " "), err, out)
	}
	return &a
}

func fail(t *testing.T, args ...string) error {
	t.Helper()
	var out bytes.Buffer
	cmd := NewCommand(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	if err == nil {
		t.Fatalf("ambient-ebpf %s succeeded:\n%s", strings.Join(args, " "), out.String())
	}
	return err
}

// why follows each connection through every hook it meets, from the pins,
// for clients in pods, outside and on the node, TCP and UDP, both
// families; the legs name pod, hook, decision, reason and target.
func TestWhyNamesEachHookAndDecision(t *testing.T) {
	for _, mode := range []bpfobj.ProbeMode{bpfobj.ProbeDirect, bpfobj.ProbeSNAT} {
		t.Run(string(mode), func(t *testing.T) { whyNamesEachHookAndDecision(t, mode) })
	}
}

func whyNamesEachHookAndDecision(t *testing.T, mode bpfobj.ProbeMode) {
	m := newMeshWith(t, mode)
	a4, a6, b4, x4 := m.a.V4.String(), m.a.V6.String(), m.b.V4.String(), m.x.V4.String()
	out4 := simnode.OutsideV4.String()
	// Inbound flows meet the pod's sk_lookup where it sees the ingress
	// interface (5.17), else a tc program on the pod's interface, which
	// never sees what the pod sends itself over lo.
	sk := features.HasSkLookupIfindex() && features.HasNetnsCookieSockops()
	in := "sk_lookup"
	if !sk {
		in = "tc_ingress"
	}
	onSkLookup := func(legs ...string) []string {
		if sk {
			return legs
		}
		return nil
	}
	join := func(parts ...[]string) []string { return slices.Concat(parts...) }
	// The node side of a pod's veth has a program in the SNAT mode only,
	// which leaves forwarded traffic alone (H2).
	fwd := func(pod string) []string {
		if mode == bpfobj.ProbeSNAT {
			return []string{pod + " host_egress passed/forwarded"}
		}
		return nil
	}
	probe := []string{" connect4 passed/not_enrolled", "default/a " + in + " passed/probe_direct"}
	if mode == bpfobj.ProbeSNAT {
		probe = []string{" connect4 passed/not_enrolled", "default/a host_egress translated/probe_snat 169.254.7.127", "default/a " + in + " passed/probe_source"}
	}
	// The redirected SYN on a's own lo, and the connection from a's
	// ztunnel to its original destination, around every outbound capture.
	captured := func(to string, hook string) []string {
		return join([]string{"default/a " + hook + " captured/outbound " + to}, onSkLookup("default/a sk_lookup passed/from_pod"),
			[]string{"default/a " + hook + " passed/ztunnel_mark"})
	}
	cases := []struct {
		args []string
		want []string
	}{
		{[]string{"default/a", out4 + ":8080"}, captured(a4+":15001", "connect4")},
		{[]string{"default/a", "[" + simnode.OutsideV6.String() + "]:8080"}, captured("["+a6+"]:15001", "connect6")},
		{[]string{"default/a", "default/b:8080"}, join(captured(a4+":15001", "connect4"),
			fwd("default/b"), []string{"default/b " + in + " captured/inbound " + b4 + ":15006", "default/b connect4 passed/ztunnel_mark"},
			onSkLookup("default/b sk_lookup passed/ztunnel_delivery"))},
		{[]string{out4, "default/x:8080"}, join(fwd("default/x"), []string{"default/x " + in + " dropped/no_listener"})},
		{[]string{"node", "default/a:8080"}, probe},
		{[]string{out4, "default/d:8080"}, join(fwd("default/d"), []string{"default/d " + in + " passed/ingress_mode"})},
		{[]string{out4, "default/a:15008"}, join(fwd("default/a"), []string{"default/a " + in + " passed/hbone_port"})},
		{[]string{"default/a", out4 + ":53", "udp"}, []string{"default/a connect4 captured/dns 127.0.0.1:15053", "default/a connect4 passed/ztunnel_mark"}},
		{[]string{"default/d", out4 + ":53", "udp"}, []string{"default/d connect4 passed/dns_capture_off"}},
		{[]string{"default/a", out4 + ":9999", "udp"}, []string{"default/a connect4 passed/udp_not_dns"}},
		{[]string{"default/a", "127.0.0.1:8081"}, []string{"default/a connect4 passed/loopback"}},
		{[]string{"default/a", "default/a:8080"}, join([]string{"default/a connect4 passed/own_ip"}, onSkLookup("default/a sk_lookup passed/from_pod"))},
		{[]string{"--mark", "0x539", "default/a", out4 + ":8080"}, []string{"default/a connect4 passed/ztunnel_mark"}},
		{[]string{"default/a", "169.254.7.127:8082"}, []string{"default/a connect4 passed/probe_destination"}},
		{[]string{a4, out4 + ":8080"}, captured(a4+":15001", "connect4")}, // a pod's address is the pod
		{[]string{"--via", "virt0", "default/e", out4 + ":8080"}, []string{"default/e reroute captured/reroute " + out4 + ":15001", "default/e connect4 passed/ztunnel_mark"}},
		{[]string{"default/a", x4 + ":8080"}, join(captured(a4+":15001", "connect4"),
			fwd("default/x"), []string{"default/x " + in + " dropped/no_listener"})},
	}
	for _, c := range cases {
		t.Run(strings.Join(c.args, "_"), func(t *testing.T) {
			a := whyJSON(t, m.n.BPFFSDir, c.args...)
			var got []string
			for _, l := range a.Legs {
				got = append(got, legString(l))
				if len(l.Steps) == 0 || l.Steps[len(l.Steps)-1].Row != l.Row {
					t.Errorf("leg %s: the last step is not its decision's row %s: %+v", legString(l), l.Row, l.Steps)
				}
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("legs\n got: %q\nwant: %q", got, c.want)
			}
		})
	}

	// The first leg of an outbound capture, step by step, in the table.
	a := whyJSON(t, m.n.BPFFSDir, "default/a", out4+":8080")
	var rows []string
	for _, s := range a.Legs[0].Steps {
		rows = append(rows, s.Row)
	}
	if want := []string{"R16", "R2", "R3", "R4", "R8", "R9", "R1"}; !slices.Equal(rows, want) {
		t.Errorf("steps of the outbound capture: rows %v, want %v", rows, want)
	}
	if want := "captured in default/a (R1: outbound TCP to ztunnel's :15001)"; a.Summary != want {
		t.Errorf("summary %q, want %q", a.Summary, want)
	}
	if b := whyJSON(t, m.n.BPFFSDir, "default/a", "default/b:8080"); b.Summary != "captured in default/a (R1: outbound TCP to ztunnel's :15001); captured in default/b (R5: inbound TCP to ztunnel's :15006)" {
		t.Errorf("summary of a to b: %q", b.Summary)
	}
	if a.From != "default/a" || a.To != netip.MustParseAddrPort(out4+":8080") || a.Proto != "tcp" || a.Legs[0].Src != netip.AddrPortFrom(m.a.V4, 0) {
		t.Errorf("answer names %s -> %s %s from %s", a.From, a.To, a.Proto, a.Legs[0].Src)
	}
	table := run(t, "--bpffs", m.n.BPFFSDir, "why", "default/a", out4)
	for _, want := range []string{
		"default/a -> " + out4 + ":* tcp: captured in default/a (R1: outbound TCP to ztunnel's :15001)",
		"1. connect4 in default/a: " + a4 + " -> " + out4 + ":*",
		"R9   any port but DNS (53)",
		"captured: outbound TCP to ztunnel's :15001 -> " + a4 + ":15001",
		". connect4 in default/a (ztunnel): " + a4 + " -> " + out4 + ":*",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("why table lacks %q:\n%s", want, table)
		}
	}

	// Errors: a clear message and a non-zero exit.
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--bpffs", m.n.BPFFSDir, "why", "default/nope", out4}, "pod default/nope: no such pod is enrolled on this node (ambient-ebpf pods lists them)"},
		{[]string{"--bpffs", m.n.BPFFSDir, "why", "default/a", "default/nope:80"}, "pod default/nope: no such pod is enrolled on this node"},
		{[]string{"--bpffs", m.n.BPFFSDir, "why", "default/a", out4, "sctp"}, `protocol "sctp": want tcp or udp`},
		{[]string{"--bpffs", m.n.BPFFSDir, "why", "nowhere", out4}, `FROM "nowhere": not NAMESPACE/NAME, an address or "node"`},
		{[]string{"--bpffs", t.TempDir(), "why", "default/a", out4}, "no ambient-ebpf data path pinned here (is the agent installed on this node? see --bpffs)"},
		{[]string{"--bpffs", m.n.BPFFSDir, "why", "--via", "virt0", "default/a", out4}, `pod default/a: virt0 is not one of its virtual interfaces (istio.io/reroute-virtual-interfaces: "")`},
	} {
		if err := fail(t, c.args...); !strings.Contains(err.Error(), c.want) {
			t.Errorf("ambient-ebpf %s: %v, want %q", strings.Join(c.args, " "), err, c.want)
		}
	}
}
