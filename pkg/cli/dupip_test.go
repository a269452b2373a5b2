// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// A pod the journal records as enrolled whose ae_pods entry is gone (what
// a duplicate's removal left under an agent before the refusal) is shown
// as inconsistent, with the address it lost, by pods and status; status
// exits non-zero even with the agent ready.
func TestPodsAndStatusShowAPodWhoseEntryIsGone(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("dupweb")
	cfg := dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	dp, err := dataplane.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if d, err := dataplane.New(cfg); err == nil {
			_ = d.Uninstall()
		}
	})
	if err := dp.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: "shop", Name: "web", Netns: p.NetnsPath(), IPs: p.IPs()}); err != nil {
		t.Fatal(err)
	}
	dp.Close()
	m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", "ae_pods"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Delete(p.V4.As16()); err != nil {
		t.Fatal(err)
	}

	pods := run(t, "--bpffs", n.BPFFSDir, "pods")
	if !strings.Contains(pods, p.V4.String()) || !strings.Contains(pods, "inconsistent: no ae_pods entry for "+p.V4.String()) {
		t.Errorf("pods does not show the pod's lost address as inconsistent:\n%s", pods)
	}
	socket := fakeAgent(t, &inspectv1.StatusResponse{Ready: true, Node: "n1"})
	out, err := runErr("--bpffs", n.BPFFSDir, "--inspect-socket", socket, "-o", "json", "status")
	if !errors.Is(err, ErrUnhealthy) {
		t.Errorf("status with an inconsistent pod: %v, want ErrUnhealthy", err)
	}
	var st Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if len(st.Inconsistent) != 1 || st.Inconsistent[0].Pod != "shop/web" || !strings.Contains(st.Inconsistent[0].Problem, p.V4.String()) {
		t.Errorf("status inconsistentPods = %+v, want shop/web losing %s", st.Inconsistent, p.V4)
	}
}
