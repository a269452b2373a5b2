// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// ztunnel listened in the pod before the data path existed, as after a
// takeover from istio-cni (whose pods ztunnel already serves) or pins lost
// while it ran: no sockops event files its inbound listener, so the
// enrolment does (bpf/listeners.c), and new inbound connections reach
// ztunnel's :15006 on both families (R5) instead of going past it.
func TestInboundReachesAListenerOpenedBeforeTheDataPath(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("early")
	zt := n.StartZtunnel()
	zt.Add(p) // its listeners open now, with no data path to see them
	app := n.StartApp(p)
	out := n.StartOutsideApp()
	d, err := dataplane.New(ebpfConfig(n))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs(), Running: true}); err != nil {
		t.Fatal(err)
	}
	for fam, a := range map[string]netip.Addr{"ipv4": p.V4, "ipv6": p.V6} {
		dst := netip.AddrPortFrom(a, 7009)
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: dst}); err != nil {
			t.Fatal(err)
		}
		resp, err := out.Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: dst})
		if err != nil {
			t.Fatalf("%s: connect to the enrolled pod: %v", fam, err)
		}
		if _, err := out.Do(simnode.AppRequest{Op: "stream-echo", Name: fam, DNSName: "hello"}); err != nil {
			t.Errorf("%s: echo through ztunnel: %v", fam, err)
		}
		r, ok := zt.RecordFor(resp.Local)
		for end := time.Now().Add(3 * time.Second); !ok && time.Now().Before(end); r, ok = zt.RecordFor(resp.Local) {
			time.Sleep(20 * time.Millisecond)
		}
		if !ok || r.Listener != 15006 {
			t.Errorf("%s: the inbound connection from %s did not go through ztunnel's :15006 (record %+v, found %v)", fam, resp.Local, r, ok)
		}
	}
}
