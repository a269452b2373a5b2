// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
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

// overtaken is a delivery of ztunnel's to the app of its own pod (R10)
// that the pod's enrolment overtook.
type overtaken struct {
	fam  string
	resp simnode.AppResponse
	err  error
}

// overtake opens ztunnel's deliveries to port on p, one per family (its
// mark, from the outside addresses, IP_TRANSPARENT), as on a takeover from
// istio-cni, whose pods ztunnel already serves: the connects come before
// the pod's entries, so sockops does not file them. Their SYNs are held
// (dropped in the pod) until the enrolment of p, running, is done; the
// retransmissions then go through, each connect giving up after timeout.
// It returns the data path, each family's delivering side, and the
// outcomes of the connects as they come.
func overtake(t *testing.T, n *simnode.Node, p *simnode.Pod, port uint16, timeout time.Duration) (*Dataplane, map[string]*simnode.App, <-chan overtaken) {
	t.Helper()
	nftIn(t, p.NetnsPath(), fmt.Sprintf("table inet ae_test_hold {\n chain input {\n  type filter hook input priority 0;\n  tcp dport %d counter drop\n }\n}\n", port), "-f", "-")
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
	fams := map[string][2]netip.Addr{"ipv4": {simnode.OutsideV4, p.V4}, "ipv6": {simnode.OutsideV6, p.V6}}
	// ztunnel's delivering side, one per family (a helper serves one
	// request at a time): its socket, its mark.
	delivery := map[string]*simnode.App{}
	for fam := range fams {
		delivery[fam] = n.StartApp(p)
	}
	done := make(chan overtaken, len(fams))
	for fam, a := range fams {
		go func() {
			resp, err := delivery[fam].Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: netip.AddrPortFrom(a[1], port),
				Mark: standin.Mark, Bind: netip.AddrPortFrom(a[0], 0), Transparent: true, Timeout: timeout})
			done <- overtaken{fam, resp, err}
		}()
	}
	if !testenv.Poll(10*time.Second, func() bool { return held() >= len(fams) }) {
		t.Fatalf("the deliveries' first SYNs never came (%d held)", held())
	}

	d := newDataplane(t, n)
	pod := podOf(p)
	pod.Running = true
	if err := d.Enroll(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	nftIn(t, p.NetnsPath(), "", "delete", "table", "inet", "ae_test_hold")
	return d, delivery, done
}

// waitNoLocalFlows waits (5 s at most) for ae_local_flows to be empty.
func waitNoLocalFlows(t *testing.T, d *Dataplane, after string) {
	t.Helper()
	if !testenv.Poll(5*time.Second, func() bool { return countEntries[bpfobj.SockSteerKey, uint32](t, d.sock.AeLocalFlows) == 0 }) {
		t.Errorf("ae_local_flows holds %d entries after %s", countEntries[bpfobj.SockSteerKey, uint32](t, d.sock.AeLocalFlows), after)
	}
}

// A delivery the pod's enrolment overtook (see overtake) must reach the
// app, on both families, not be captured into ztunnel's own :15006
// listener, where it would hang; and the entry filed for it on the way
// goes with the socket.
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
	d, delivery, done := overtake(t, n, p, port, 20*time.Second)
	for range delivery {
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
	waitNoLocalFlows(t, d, "the deliveries closed")
}

// A delivery the enrolment overtook that never connects (the app does not
// listen; the kernel's RST, unmarked, leaves the pod) leaves its entry in
// ae_local_flows: the pod's lo program filed it, and sockops, which
// removes an entry when its socket closes, is asked to watch the socket
// only once it is established. The pod's removal takes it
// (pruneLocalFlows): left, it would hand a later SYN of that tuple to a pod
// with the address straight to its app. Where inbound capture is tc's
// (before 5.17) nothing is filed, and nothing must be left either.
func TestRemovingAPodPrunesItsLeftoverDeliveries(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("refused")
	zt := n.StartZtunnel()
	zt.Add(p)
	// Nobody listens; 10 s lets the SYNs retransmitted at 1, 3 and 7 s
	// through an enrolment that takes seconds under emulation.
	d, delivery, done := overtake(t, n, p, 7017, 10*time.Second)
	if d.bpfFlags&bpfobj.CfgSkLookupIfindex != 0 {
		if !testenv.Poll(10*time.Second, func() bool { return countEntries[bpfobj.SockSteerKey, uint32](t, d.sock.AeLocalFlows) >= len(delivery) }) {
			t.Fatalf("ae_local_flows holds %d entries, want the %d deliveries' (filed as their SYNs were retransmitted)",
				countEntries[bpfobj.SockSteerKey, uint32](t, d.sock.AeLocalFlows), len(delivery))
		}
	}
	if err := d.Remove(context.Background(), p.UID); err != nil {
		t.Fatal(err)
	}
	waitNoLocalFlows(t, d, "the pod's removal")
	for range delivery {
		if o := <-done; o.err == nil {
			t.Errorf("%s: ztunnel's delivery to a port nobody listens on connected: %+v", o.fam, o.resp)
		}
	}
}

// An agent that starts prunes what a stopped one left in ae_local_flows for
// addresses no pod is enrolled with (its pod removed meanwhile, in a way
// the journal does not show), and keeps the entries of enrolled pods.
func TestStartPrunesLeftoverDeliveries(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("kept")
	d1, err := New(Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	if err := d1.Enroll(context.Background(), podOf(p)); err != nil {
		t.Fatal(err)
	}
	kept := bpfobj.SockSteerKey{Saddr: bpfobj.AddrKey(simnode.OutsideV4), Daddr: bpfobj.AddrKey(p.V4), Sport: 40001, Dport: 7018}
	gone := bpfobj.SockSteerKey{Saddr: bpfobj.AddrKey(simnode.OutsideV4), Daddr: bpfobj.AddrKey(netip.MustParseAddr("198.18.255.254")), Sport: 40002, Dport: 7018}
	for _, k := range []bpfobj.SockSteerKey{kept, gone} {
		if err := d1.sock.AeLocalFlows.Put(&k, uint32(1)); err != nil {
			t.Fatal(err)
		}
	}
	if err := d1.Close(); err != nil {
		t.Fatal(err)
	}
	d2 := newDataplane(t, n)
	var v uint32
	if err := d2.sock.AeLocalFlows.Lookup(&kept, &v); err != nil {
		t.Errorf("the entry of an enrolled pod's delivery is gone after the restart: %v", err)
	}
	if err := d2.sock.AeLocalFlows.Lookup(&gone, &v); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("the entry of an address no pod has is still there after the restart: %v", err)
	}
}
