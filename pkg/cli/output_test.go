// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// fakeAgent serves the inspection API on a socket of the test and answers
// Status with resp.
func fakeAgent(t *testing.T, resp *inspectv1.StatusResponse) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "inspect.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	inspectv1.RegisterInspectServer(g, statusServer{resp: resp})
	done := make(chan error, 1)
	go func() { done <- g.Serve(ln) }()
	t.Cleanup(func() {
		g.Stop()
		<-done
	})
	return path
}

type statusServer struct {
	inspectv1.UnimplementedInspectServer
	resp *inspectv1.StatusResponse
}

func (s statusServer) Status(context.Context, *inspectv1.StatusRequest) (*inspectv1.StatusResponse, error) {
	return s.resp, nil
}

// status exits non-zero, after printing its report, whenever the agent is
// not there to answer ready, with the table and with JSON.
func TestStatusExitsNonZeroUnlessTheAgentAnswersReady(t *testing.T) {
	noPins := filepath.Join(t.TempDir(), "none")
	cases := []struct {
		name      string
		socket    func(t *testing.T) string
		wantErr   string // "" for success
		wantAgent bool
	}{
		{
			name:    "agent unreachable and nothing pinned",
			socket:  func(t *testing.T) string { return filepath.Join(t.TempDir(), "absent.sock") },
			wantErr: "the agent does not answer and nothing is pinned",
		},
		{
			name:      "agent not ready",
			socket:    func(t *testing.T) string { return fakeAgent(t, &inspectv1.StatusResponse{NotReadyReason: "starting"}) },
			wantErr:   "the agent is not ready: starting",
			wantAgent: true,
		},
		{
			name:      "agent ready",
			socket:    func(t *testing.T) string { return fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1"}) },
			wantAgent: true,
		},
		{
			// gRPC's "unix://" target reads a relative path's first
			// element as an authority and refused it.
			name: "agent ready, its socket named by a relative path",
			socket: func(t *testing.T) string {
				cwd, err := os.Getwd()
				if err != nil {
					t.Fatal(err)
				}
				rel, err := filepath.Rel(cwd, fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1"}))
				if err != nil {
					t.Fatal(err)
				}
				return rel
			},
			wantAgent: true,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			socket := tc.socket(t)
			for _, format := range []string{"table", "json"} {
				out, err := runErr("--bpffs", noPins, "--inspect-socket", socket, "-o", format, "status")
				switch {
				case tc.wantErr == "" && err != nil:
					t.Errorf("-o %s: %v", format, err)
				case tc.wantErr != "" && (!errors.Is(err, ErrUnhealthy) || !strings.Contains(err.Error(), tc.wantErr)):
					t.Errorf("-o %s: error %v, want ErrUnhealthy saying %q", format, err, tc.wantErr)
				}
				if format == "table" {
					if !strings.Contains(out, "data path pinned") {
						t.Errorf("-o table printed no report:\n%s", out)
					}
					continue
				}
				var st Status
				if err := json.Unmarshal([]byte(out), &st); err != nil {
					t.Fatalf("-o json: %v\n%s", err, out)
				}
				if (st.Agent != nil) != tc.wantAgent || st.Installed {
					t.Errorf("-o json decoded to %+v", st)
				}
			}
		})
	}
}

// The agent's protobuf answer is in protojson's names, with its zero fields.
func TestStatusJSONHasTheAgentsFieldsInCamelCase(t *testing.T) {
	socket := fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1", Features: map[string]bool{"sk_lookup": true}})
	out := run(t, "--bpffs", filepath.Join(t.TempDir(), "none"), "--inspect-socket", socket, "-o", "json", "status")
	var raw struct {
		Agent map[string]any `json:"agent"`
	}
	if err := json.Unmarshal([]byte(out), &raw); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	want := []string{"bpffsDir", "enrolledPods", "features", "istioCni", "istioCniHandback", "istioCniTakeover", "node", "notReadyReason", "pendingPods", "ready", "source", "ztunnelConnections"}
	got := slices.Sorted(func(yield func(string) bool) {
		for k := range raw.Agent {
			if !yield(k) {
				return
			}
		}
	})
	if !slices.Equal(got, want) {
		t.Errorf("agent fields %v, want %v:\n%s", got, want, out)
	}
	var st Status
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Agent.GetNode() != "n1" || !st.Agent.GetFeatures()["sk_lookup"] {
		t.Errorf("status does not decode back: %+v, %v", st.Agent, err)
	}
}

// The table names the takeover's settings and each pod a takeover saw,
// with what is left of it: connections still draining, or why a pod stays
// on istio-cni.
func TestStatusTableShowsTheIstioCNITakeover(t *testing.T) {
	socket := fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1", IstioCniTakeover: true, IstioCniHandback: "iptables-nft",
		IstioCni: []*inspectv1.IstioCNIPod{
			{Namespace: "shop", Name: "web", Phase: "draining istio-cni's connections", Flows: 3},
			{Namespace: "shop", Name: "db", Phase: "left on istio-cni", Reason: "an extra rule in ISTIO_PRERT"},
			{Namespace: "shop", Name: "cart", Phase: "taken over"},
		}})
	out := run(t, "--bpffs", filepath.Join(t.TempDir(), "none"), "--inspect-socket", socket, "status")
	for _, want := range []string{
		`istio-cni takeover\s+true \(hand-back on uninstall: iptables-nft\)`,
		`istio-cni pod shop/web\s+draining istio-cni's connections \(3 left\)\n`,
		`istio-cni pod shop/db\s+left on istio-cni: an extra rule in ISTIO_PRERT\n`,
		`istio-cni pod shop/cart\s+taken over\n`,
	} {
		if !regexp.MustCompile(want).MatchString(out) {
			t.Errorf("status does not match %q:\n%s", want, out)
		}
	}
	off := fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1"})
	if out := run(t, "--bpffs", filepath.Join(t.TempDir(), "none"), "--inspect-socket", off, "status"); !regexp.MustCompile(`istio-cni takeover\s+false \(hand-back on uninstall: off\)`).MatchString(out) ||
		strings.Contains(out, "istio-cni pod") {
		t.Errorf("status with the takeover off:\n%s", out)
	}
}

// jsonCase is how TestEveryCommandsJSON runs a command: with args, and
// whether the command may exit non-zero (doctor, on a test node without
// a CNI configuration of the runtime's) as long as its JSON is right.
type jsonCase struct {
	args    []string
	mayFail bool
	// lines: the output is a stream of JSON values, one per line (trace).
	lines bool
}

// jsonArgs are the arguments of every command for TestEveryCommandsJSON,
// on node n; a command missing here fails it.
func jsonArgs(n *simnode.Node, dir string) map[string]jsonCase {
	return map[string]jsonCase{
		"pods": {}, "maps": {}, "stats": {}, "status": {}, "version": {},
		"doctor": {args: []string{"--cgroup-root", n.CgroupRoot, "--node-netns", simnode.NetnsPath(n.NodeNS),
			"--cni-conf-dir", dir, "--zds-socket", filepath.Join(dir, "zds.sock")}, mayFail: true},
		"why":   {args: []string{"node", "198.18.0.10:8080"}},
		"trace": {args: []string{"--pins", "--duration", "200ms"}, lines: true},
	}
}

// dataKeys are the JSON objects whose keys are data, not field names:
// pinned map names and kernel feature names keep their spelling.
var dataKeys = map[string]bool{"maps": true, "status.agent.features": true}

var camelCase = regexp.MustCompile(`^[a-z][a-zA-Z0-9]*$`)

// Every command's JSON decodes, names its fields in camelCase, and shows
// an empty list as [] (never null), on an empty data path and on one with
// a pod.
func TestEveryCommandsJSON(t *testing.T) {
	n := simnode.New(t)
	cases := jsonArgs(n, t.TempDir())
	for _, c := range NewCommand(nil).Commands() {
		if _, ok := cases[c.Name()]; !ok {
			t.Errorf("command %q has no entry in jsonArgs", c.Name())
		}
	}
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dp.Uninstall() })
	agent := fakeAgent(t, &inspectv1.StatusResponse{Ready: true})
	check := func(t *testing.T) {
		for name, c := range cases {
			out, err := runErr(append([]string{"--bpffs", n.BPFFSDir, "--inspect-socket", agent, "-o", "json", name}, c.args...)...)
			if err != nil && !c.mayFail {
				t.Errorf("%s: %v", name, err)
			}
			docs := []string{out}
			if c.lines {
				docs = slices.DeleteFunc(strings.Split(out, "\n"), func(l string) bool { return strings.TrimSpace(l) == "" })
			}
			for _, doc := range docs {
				var v any
				if err := json.Unmarshal([]byte(doc), &v); err != nil {
					t.Errorf("%s -o json does not decode: %v\n%s", name, err, out)
					continue
				}
				for _, p := range checkJSON(name, v) {
					t.Errorf("%s -o json: %s\n%s", name, p, out)
				}
			}
		}
	}
	t.Run("empty", check)
	p := n.AddPod("web")
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: "shop", Name: "web", Netns: p.NetnsPath(), IPs: p.IPs()}); err != nil {
		t.Fatal(err)
	}
	t.Run("one pod", check)
}

// checkJSON lists what breaks the output rules in a decoded value.
func checkJSON(path string, v any) []string {
	var problems []string
	switch v := v.(type) {
	case nil:
		problems = append(problems, path+" is null")
	case []any:
		for i, e := range v {
			problems = append(problems, checkJSON(fmt.Sprintf("%s[%d]", path, i), e)...)
		}
	case map[string]any:
		for k, e := range v {
			if !dataKeys[path] && !camelCase.MatchString(k) {
				problems = append(problems, fmt.Sprintf("%s: key %q is not camelCase", path, k))
			}
			problems = append(problems, checkJSON(path+"."+k, e)...)
		}
	}
	return problems
}
