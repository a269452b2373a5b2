// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock/unixsocktest"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/doctor"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func run(t *testing.T, args ...string) string {
	t.Helper()
	out, err := runErr(args...)
	if err != nil {
		t.Fatalf("ambient-ebpf %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// runErr runs the command and returns what it printed and its error.
func runErr(args ...string) (string, error) {
	var out bytes.Buffer
	cmd := NewCommand(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

// The CLI reads the pins with no agent running: pods, maps (dotted and
// colon addresses, pod names beside IPs), stats, JSON on every command.
func TestCommandsReadPinsWithoutTheAgent(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("web")
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if d, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}); err == nil {
			_ = d.Uninstall()
		}
	})
	err = dp.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: "shop", Name: "web", Netns: p.NetnsPath(),
		IPs: p.IPs(), Options: podopts.Options{DNSCapture: true}})
	if err != nil {
		t.Fatal(err)
	}
	dp.Close() // the agent is gone; the pins stay

	pods := run(t, "--bpffs", n.BPFFSDir, "pods")
	for _, want := range []string{"shop/web", p.UID, p.V4.String(), p.V6.String(), "dns"} {
		if !strings.Contains(pods, want) {
			t.Errorf("pods output lacks %q:\n%s", want, pods)
		}
	}
	maps := run(t, "--bpffs", n.BPFFSDir, "maps")
	for _, want := range []string{"ae_pods (2)", p.V4.String() + "  ", "shop/web", "ae_netns (1)", "ae_probe_nat"} {
		if !strings.Contains(maps, want) {
			t.Errorf("maps output lacks %q:\n%s", want, maps)
		}
	}
	var got []inspect.EnrolledPod
	if err := json.Unmarshal([]byte(run(t, "--bpffs", n.BPFFSDir, "-o", "json", "pods")), &got); err != nil || len(got) != 1 || got[0].Name != "web" {
		t.Errorf("pods -o json = %+v, %v", got, err)
	}
}

// bpftool prints the same pins with BTF field names.
func TestBpftoolPrintsFieldNames(t *testing.T) {
	testenv.RequireRoot(t) // before the tool: make test-unit runs it unprivileged
	if _, err := exec.LookPath("bpftool"); err != nil {
		t.Fatal("bpftool is not installed (make deps installs it)")
	}
	n := simnode.New(t)
	p := n.AddPod("web")
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Uninstall()
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: "shop", Name: "web", Netns: p.NetnsPath(), IPs: p.IPs()}); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("bpftool", "map", "dump", "pinned", filepath.Join(n.BPFFSDir, "maps", "ae_netns")).CombinedOutput()
	if err != nil {
		t.Fatalf("bpftool: %v: %s", err, out)
	}
	for _, field := range []string{`"ip4"`, `"ip6"`, `"slot"`, `"flags"`} {
		if !bytes.Contains(out, []byte(field)) {
			t.Errorf("bpftool dump lacks field %s:\n%s", field, out)
		}
	}
}

// TestStatusGivesUpOnAnAgentThatNeverAnswers: an agent that accepts the
// connection but never answers is reported unreachable within the deadline.
func TestStatusGivesUpOnAnAgentThatNeverAnswers(t *testing.T) {
	start := time.Now()
	out, err := runErr("--bpffs", filepath.Join(t.TempDir(), "none"), "--inspect-socket", unixsocktest.Mute(t),
		"--agent-timeout", "300ms", "-o", "json", "status")
	if !errors.Is(err, ErrUnhealthy) {
		t.Errorf("status of a mute agent returned %v, want ErrUnhealthy", err)
	}
	var st Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	if st.Agent != nil || !strings.Contains(st.AgentError, "no answer within 300ms") {
		t.Errorf("status of a mute agent: %+v", st)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("status took %v with a 300ms agent timeout", took)
	}
}

// doctor answers in JSON, exits zero on a sound node and non-zero, saying
// how many checks failed, where the bpffs is missing.
func TestDoctorExitCodeAndJSON(t *testing.T) {
	n := simnode.New(t)
	confDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(confDir, "10-podnet.conflist"), []byte(`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"ptp"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	args := []string{"--inspect-socket", filepath.Join(t.TempDir(), "none.sock"), "doctor", "--cgroup-root", n.CgroupRoot,
		"--node-netns", simnode.NetnsPath(n.NodeNS), "--cni-conf-dir", confDir, "--zds-socket", filepath.Join(t.TempDir(), "zds.sock")}
	var r doctor.Report
	if err := json.Unmarshal([]byte(run(t, append([]string{"--bpffs", n.BPFFSDir, "-o", "json"}, args...)...)), &r); err != nil {
		t.Fatalf("doctor -o json: %v", err)
	}
	if r.Failed() || len(r.Findings) == 0 || r.Counts[doctor.OK] == 0 {
		t.Errorf("doctor on a sound node: %+v", r)
	}
	var out bytes.Buffer
	cmd := NewCommand(&out)
	cmd.SetArgs(append([]string{"--bpffs", filepath.Join(t.TempDir(), "ambient-ebpf")}, args...))
	err := cmd.ExecuteContext(context.Background())
	if err == nil || !strings.Contains(err.Error(), "doctor: 1 of ") || !strings.Contains(out.String(), "is not a bpffs") {
		t.Errorf("doctor without a bpffs: err %v, output:\n%s", err, out.String())
	}
}
