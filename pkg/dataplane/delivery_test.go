// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// nftIn runs nft with script on stdin in the netns at path.
func nftIn(t *testing.T, path, script string, args ...string) string {
	t.Helper()
	cmd := exec.Command("nsenter", append([]string{"--net=" + path, "nft"}, args...)...)
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("nft %v in %s: %v\n%s", args, path, err, out)
	}
	return string(out)
}

// ztunnel's connection to the app of its own pod (R10), on its way when the
// pod is enrolled, as on a takeover from istio-cni, whose pods ztunnel
// already serves: the connect comes before the pod's entries, so sockops
// does not file it, and its SYN (dropped here until the enrolment is done)
// is retransmitted after. It must reach the app, on both families, not be
// captured into ztunnel's own :15006 listener, where it would hang; and the
// entry filed for it on the way goes with the socket.
func TestADeliveryTheEnrolmentOvertookReachesTheApp(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("overtaken")
	zt := n.StartZtunnel()
	zt.Add(p)
	app := n.StartApp(p)
	const port = 7015
	if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), port)}); err != nil {
		t.Fatal(err)
	}
	nftIn(t, p.NetnsPath(), "table inet ae_test_hold {\n chain input {\n  type filter hook input priority 0;\n  tcp dport 7015 counter drop\n }\n}\n", "-f", "-")
	held := func() int {
		out := nftIn(t, p.NetnsPath(), "", "list", "table", "inet", "ae_test_hold")
		_, after, _ := strings.Cut(out, "counter packets ")
		var k int
		for _, c := range after {
			if c < '0' || c > '9' {
				break
			}
			k = k*10 + int(c-'0')
		}
		return k
	}

	type opened struct {
		fam  string
		resp simnode.AppResponse
		err  error
	}
	fams := map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}}
	// ztunnel's delivering side, one per family (a helper serves one
	// request at a time): its socket, its mark.
	delivery := map[string]*simnode.App{}
	for fam := range fams {
		delivery[fam] = n.StartApp(p)
	}
	done := make(chan opened, len(fams))
	for fam, a := range fams {
		go func() {
			resp, err := delivery[fam].Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: netip.AddrPortFrom(a[1], port),
				Mark: standin.Mark, Bind: netip.AddrPortFrom(a[0], 0), Transparent: true, Timeout: 20 * time.Second})
			done <- opened{fam, resp, err}
		}()
	}
	for end := time.Now().Add(10 * time.Second); held() < len(fams); {
		if time.Now().After(end) {
			t.Fatalf("the deliveries' first SYNs never came (%d held)", held())
		}
		time.Sleep(10 * time.Millisecond)
	}

	d := newDataplane(t, n)
	pod := podOf(p)
	pod.Running = true
	if err := d.Enroll(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	nftIn(t, p.NetnsPath(), "", "delete", "table", "inet", "ae_test_hold")

	for range fams {
		o := <-done
		if o.err != nil {
			t.Errorf("%s: ztunnel's delivery begun before the enrolment: %v", o.fam, o.err)
			continue
		}
		if _, err := delivery[o.fam].Do(simnode.AppRequest{Op: "stream-echo", Name: o.fam, DNSName: "hello"}); err != nil {
			t.Errorf("%s: echo from the app: %v", o.fam, err)
		}
		if r, ok := zt.RecordFor(o.resp.Local); ok {
			t.Errorf("%s: the delivery from %s went into ztunnel: %+v", o.fam, o.resp.Local, r)
		}
		if _, err := delivery[o.fam].Do(simnode.AppRequest{Op: "stream-close", Name: o.fam}); err != nil {
			t.Errorf("%s: close: %v", o.fam, err)
		}
	}
	for end := time.Now().Add(5 * time.Second); countEntries[sockSteerKey, uint32](t, d.sock.AeLocalFlows) > 0; {
		if time.Now().After(end) {
			t.Errorf("ae_local_flows holds %d entries after the deliveries closed", countEntries[sockSteerKey, uint32](t, d.sock.AeLocalFlows))
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A running pod whose ztunnel listeners predate the data path (a takeover
// from istio-cni) is enrolled, and a client connects at the moment the
// pod's entries are written (StepEnrollEntries), when its sk_lookup program
// starts capturing. The connection reaches ztunnel's :15006 on both
// families: the listeners were filed before (fileExistingListeners). Filed
// after the entries, as they were, a SYN in between found no listener and
// was refused (seen in the takeover suite as "connection refused" on 6.1
// and 6.12). Before 5.17 inbound goes through tc and the pod's listeners
// are not filed at all; the connection must reach ztunnel there too.
func TestAClientAtTheEnrolmentOfARunningPodReachesZtunnel(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("running")
	zt := n.StartZtunnel()
	zt.Add(p)
	app := n.StartApp(p)
	const port = 7016
	app.Listen("tcp", "app", netip.AddrPortFrom(netip.IPv6Unspecified(), port))
	out := n.StartOutsideApp()

	type dialed struct {
		dst  netip.AddrPort
		resp simnode.AppResponse
		err  error
	}
	var got []dialed
	d, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS),
		Failpoint: func(step string) {
			if step != StepEnrollEntries {
				return
			}
			for _, a := range []netip.Addr{p.V4, p.V6} {
				dst := netip.AddrPortFrom(a, port)
				resp, err := out.Dial("tcp", simnode.AppRequest{Addr: dst})
				got = append(got, dialed{dst, resp, err})
			}
		}})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	pod := podOf(p)
	pod.Running = true
	if err := d.Enroll(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 {
		t.Fatalf("the failpoint dialed %d times, want 2", len(got))
	}
	for _, g := range got {
		if g.err != nil {
			t.Errorf("%s at the enrolment: %v", g.dst, g.err)
			continue
		}
		r, ok := zt.RecordFor(g.resp.Local)
		if !ok || r.Listener != standin.InboundPort || r.OrigDst != g.dst || r.Error != "" {
			t.Errorf("%s at the enrolment: not through ztunnel's :%d: record %+v (found %v), answered by %+v", g.dst, standin.InboundPort, r, ok, g.resp.Reply)
		}
	}
}
