// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"os"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func TestMain(m *testing.M) {
	simnode.RunHelper()
	os.Exit(m.Run())
}

// mesh is a simulated node with the data path installed and a ztunnel
// stand-in holding these pods:
//
//	a  enrolled, DNS capture on        b  enrolled
//	d  enrolled in ingress mode, DNS capture off
//	x  enrolled, never handed to ztunnel (no listener)
//	e  enrolled with a virtual interface virt0 leading to a VM (R14)
type mesh struct {
	n             *simnode.Node
	dp            *dataplane.Dataplane
	zt            *simnode.Ztunnel
	a, b, d, x, e *simnode.Pod
	vm            *simnode.VM
}

func newMesh(t *testing.T) *mesh { return newMeshWith(t, "") }

// newMeshWith is newMesh with host probes in a mode ("": the default).
func newMeshWith(t *testing.T, probes bpfobj.ProbeMode) *mesh {
	t.Helper()
	n := simnode.New(t)
	m := &mesh{n: n, a: n.AddPod("a"), b: n.AddPod("b"), d: n.AddPod("d"), x: n.AddPod("x"), e: n.AddPod("e")}
	m.vm = n.AddVirtualInterface(m.e, "virt0")
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), HostProbes: probes})
	if err != nil {
		t.Fatal(err)
	}
	m.dp = dp
	t.Cleanup(func() { _ = dp.Uninstall() })
	m.zt = n.StartZtunnel()
	for _, p := range []struct {
		pod  *simnode.Pod
		opts podopts.Options
	}{{m.a, podopts.Options{DNSCapture: true}}, {m.b, podopts.Options{}}, {m.d, podopts.Options{BypassInbound: true}}, {m.x, podopts.Options{}},
		{m.e, podopts.Options{RerouteInterfaces: []string{"virt0"}}}} {
		if p.pod != m.x {
			m.zt.Add(p.pod)
		}
		if err := dp.Enroll(context.Background(), dataplane.Pod{UID: p.pod.UID, Namespace: p.pod.Namespace, Name: p.pod.Name,
			Netns: p.pod.NetnsPath(), IPs: p.pod.IPs(), Options: p.opts}); err != nil {
			t.Fatalf("enroll %s: %v", p.pod.Name, err)
		}
	}
	return m
}
