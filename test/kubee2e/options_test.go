// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// The per-pod options (R12 ingress mode, R13 DNS capture, R14 virtual
// interfaces) changed on a running enrolled pod through the real API server
// are applied to its data path in place, by the real agent: traffic before
// and after each change takes the path the options say, and the pod is
// never re-created nor taken out of the mesh.
func TestLiveOptionChangesAgainstAPIServer(t *testing.T) {
	c := requireCluster(t)
	ns := c.Namespace(t, "options", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	r := newAgentRun(t, c, ns.Name)
	kp, sp := r.pod("web", true, nil)
	vm := r.AddVirtualInterface(sp, "virt0")
	app := r.StartApp(sp)
	app.Listen("tcp", "web", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	vmApp := r.StartVMApp(vm)
	out := r.StartOutsideApp()
	out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), 8080))
	if _, err := out.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		t.Fatal(err)
	}
	zt := r.StartZtunnelFor(r.ZDS)
	r.start()
	r.waitFor("pod repaired in place and annotated", func() bool {
		return r.pinned()["web"] && r.annotation(kp) == enrollment.RedirectionEnabled
	})

	// Where each kind of traffic goes now: the ztunnel listener that took
	// it, or "" when it went around ztunnel.
	inbound := func() string {
		resp, err := out.Dial("tcp", simnode.AppRequest{Addr: netip.AddrPortFrom(sp.V4, 8080)})
		if err != nil {
			return "error: " + err.Error()
		}
		return listener(zt, resp.Local)
	}
	// Without rerouting the VM's connection is forwarded by the pod and
	// the node has no route back to the VM: it fails, around ztunnel
	// either way ("").
	fromVM := func() string {
		resp, err := vmApp.Dial("tcp", simnode.AppRequest{Addr: netip.AddrPortFrom(simnode.OutsideV4, 8080)})
		if err != nil {
			return ""
		}
		return listener(zt, resp.Local)
	}
	query := 0
	dns := func() netip.Addr {
		query++
		resp, err := app.Do(simnode.AppRequest{Op: "dns", Addr: netip.AddrPortFrom(simnode.OutsideV4, 53),
			DNSName: fmt.Sprintf("q%d.%s", query, simnode.KnownDNSSuffix), Proto: "udp"})
		if err != nil {
			return netip.Addr{}
		}
		return resp.Answer
	}
	check := func(step, wantInbound, wantVM string, wantDNS netip.Addr) {
		t.Helper()
		if got := inbound(); got != wantInbound {
			t.Errorf("%s: inbound to the pod went to %q; want %q", step, got, wantInbound)
		}
		if got := fromVM(); got != wantVM {
			t.Errorf("%s: TCP from behind virt0 went to %q; want %q", step, got, wantVM)
		}
		if got := dns(); got != wantDNS {
			t.Errorf("%s: DNS answered %v; want %v", step, got, wantDNS)
		}
	}
	inboundPort, outboundPort := fmt.Sprint(standin.InboundPort), fmt.Sprint(standin.OutboundPort)
	// The defaults: inbound captured, the VM's traffic forwarded around
	// ztunnel, DNS answered by ztunnel.
	check("before", inboundPort, "", simnode.KnownDNSAnswer)

	annotate := func(values map[string]any) {
		t.Helper()
		body := mustJSON(t, map[string]any{"metadata": map[string]any{"annotations": values}})
		if _, err := c.Client.CoreV1().Pods(kp.Namespace).Patch(context.Background(), kp.Name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	opts := func() podopts.Options {
		view, err := inspect.OpenPinned(r.BPFFSDir)
		if err != nil {
			return podopts.Options{}
		}
		defer view.Close()
		pods, _ := view.Pods()
		for _, p := range pods {
			if p.Name == "web" {
				return p.Options
			}
		}
		return podopts.Options{}
	}
	uid := r.pinnedUID("web")

	annotate(map[string]any{enrollment.BypassInboundAnnotation: "true", enrollment.DNSCaptureAnnotation: "false",
		enrollment.RerouteInterfacesAnnotation: "virt0"})
	r.waitFor("ingress mode and DNS capture off in the data path", func() bool { o := opts(); return o.BypassInbound && !o.DNSCapture })
	r.waitFor("virt0 rerouted", func() bool { return fromVM() == outboundPort })
	check("after", "", outboundPort, simnode.OutsideDNSAnswer)

	annotate(map[string]any{enrollment.BypassInboundAnnotation: nil, enrollment.DNSCaptureAnnotation: nil,
		enrollment.RerouteInterfacesAnnotation: nil})
	r.waitFor("the defaults back in the data path", func() bool { o := opts(); return !o.BypassInbound && o.DNSCapture })
	r.waitFor("virt0 no longer rerouted", func() bool { return fromVM() == "" })
	check("back", inboundPort, "", simnode.KnownDNSAnswer)

	// In place: the same pod, the same pins, never out of the mesh.
	if got := r.pinnedUID("web"); got != uid || got != string(kp.UID) {
		t.Errorf("pinned uid %q after the changes; want %q throughout", got, kp.UID)
	}
	if a := r.annotation(kp); a != enrollment.RedirectionEnabled {
		t.Errorf("annotation %q after the changes; want enabled", a)
	}
	if _, m := r.Get("/metrics"); !strings.Contains(m, "ambient_ebpf_remove_duration_seconds_count 0") {
		t.Errorf("the agent removed a pod from the data path on the way")
	}
	if err := r.Stop(15 * time.Second); err != nil {
		t.Error(err)
	}
}

// listener names the ztunnel listener that took the connection from peer,
// or "" when ztunnel did not see it.
func listener(zt *simnode.Ztunnel, peer netip.AddrPort) string {
	rec, ok := zt.RecordFor(peer)
	if !ok {
		return ""
	}
	return fmt.Sprint(rec.Listener)
}

func (r *agentRun) pinnedUID(name string) string {
	view, err := inspect.OpenPinned(r.BPFFSDir)
	if err != nil {
		return ""
	}
	defer view.Close()
	pods, _ := view.Pods()
	for _, p := range pods {
		if p.Name == name {
			return p.UID
		}
	}
	return ""
}
