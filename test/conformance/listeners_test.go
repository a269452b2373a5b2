// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
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
	inboundThroughZtunnel(t, p, zt, app, out)
}

// inboundThroughZtunnel connects from outside to the pod's app on both
// families and checks each connection went through ztunnel's :15006 (R5).
func inboundThroughZtunnel(t *testing.T, p *simnode.Pod, zt *simnode.Ztunnel, app, out *simnode.App) {
	t.Helper()
	for fam, a := range map[string]netip.Addr{"ipv4": p.V4, "ipv6": p.V6} {
		dst := netip.AddrPortFrom(a, 7009)
		if _, err := app.Do(simnode.AppRequest{Op: "listen-echo", Addr: dst}); err != nil {
			t.Fatal(err)
		}
		resp, err := out.Do(simnode.AppRequest{Op: "stream-open", Name: fam, Addr: dst})
		if err != nil {
			t.Errorf("%s: connect to the enrolled pod: %v", fam, err)
			continue
		}
		if _, err := out.Do(simnode.AppRequest{Op: "stream-echo", Name: fam, DNSName: "hello"}); err != nil {
			t.Errorf("%s: echo through ztunnel: %v", fam, err)
		}
		var r standin.Record
		ok := testenv.Poll(3*time.Second, func() (found bool) { r, found = zt.RecordFor(resp.Local); return found })
		if !ok || r.Listener != 15006 {
			t.Errorf("%s: the inbound connection from %s did not go through ztunnel's :15006 (record %+v, found %v)", fam, resp.Local, r, ok)
		}
	}
}

// An unprivileged local user (uid nobody) who makes a user namespace holds
// CAP_NET_ADMIN over netns of its own, so it can listen on ztunnel's
// inbound port with ztunnel's mark in as many netns as it likes, below the
// node's cgroup root where the socket hooks are. Its listeners take no
// room in the node's ae_listeners: after a flood that filled the table as
// sockops filed before (every slot of more netns than the table has room
// for), a pod enrolled afterwards still has its inbound connections
// captured by ztunnel's :15006 (R5), and the table holds only the enrolled
// pod's listeners.
func TestListenerFloodFromAUserNamespaceLeavesLaterPodsCaptured(t *testing.T) {
	n := simnode.New(t)
	d, zt := startWithZtunnel(t, n)
	// 2 x 4100 netns, 4 listeners each: more than the 8192 x 4 slots.
	for range 2 {
		n.StartListenFlood(4100)
	}

	p := enrollAndHand(t, n, d, zt, "late")
	inboundThroughZtunnel(t, p, zt, n.StartApp(p), n.StartOutsideApp())

	st, err := d.ResyncListeners(context.Background())
	switch {
	case err != nil:
		t.Fatal(err)
	case !listenersFiled():
		if !reflect.DeepEqual(st, inspect.ListenerStatus{}) {
			t.Errorf("inbound goes through tc on this kernel, yet ae_listeners reports %+v", st)
		}
	case st.NotEnrolled != 0 || st.Pruned != 0 || st.Entries == 0 || st.Entries > simnode.ListenersPerNetns || len(st.Missing) != 0:
		t.Errorf("ae_listeners after the flood: %+v; want only the enrolled pod's listeners", st)
	}
}

// listenersFiled says whether the data path files ztunnel's listeners in
// ae_listeners on this kernel: only where sk_lookup alone captures
// inbound (Linux 5.17); before, tc finds them by lookup.
func listenersFiled() bool {
	return features.HasSkLookupIfindex() && features.HasNetnsCookieSockops()
}

// A listener the table left out (it was full as ztunnel listened) is filed
// by the agent's resync once there is room, not only when ztunnel opens it
// again; an entry of a netns that is not enrolled (a removed pod's, or one
// an earlier agent's sockops filed for anyone) is pruned.
func TestResyncFilesAListenerTheTableLeftOutAndPrunesOthers(t *testing.T) {
	n := simnode.New(t)
	d, zt := startWithZtunnel(t, n)
	p := enrollAndHand(t, n, d, zt, "left-out")
	if !listenersFiled() {
		t.Log("inbound goes through tc on this kernel: ae_listeners is not used") // no skip: inbound must still work
		if st, err := d.ResyncListeners(context.Background()); err != nil || !reflect.DeepEqual(st, inspect.ListenerStatus{}) {
			t.Errorf("resync without ae_listeners: %+v, %v", st, err)
		}
		inboundThroughZtunnel(t, p, zt, n.StartApp(p), n.StartOutsideApp())
		return
	}

	listeners, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", "ae_listeners"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer listeners.Close()
	// What the full table did: the pod's listener is not in it.
	var (
		keys [][]byte
		k    []byte
		v    uint64
	)
	it := listeners.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, slices.Clone(k))
	}
	if err := it.Err(); err != nil || len(keys) == 0 {
		t.Fatalf("ae_listeners holds %d entries (%v); want the pod's", len(keys), err)
	}
	for _, k := range keys {
		if err := listeners.Delete(k); err != nil {
			t.Fatal(err)
		}
	}
	// And a listener of a netns that is not enrolled (the node's).
	if err := simnode.InNetns(n.NodeNS, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		t.Cleanup(func() { unix.Close(fd) })
		if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			return err
		}
		if err := unix.Listen(fd, 1); err != nil {
			return err
		}
		key := make([]byte, len(keys[0])) // netns cookie 1: no pod's
		key[0] = 1
		return listeners.Update(key, uint64(fd), ebpf.UpdateNoExist)
	}); err != nil {
		t.Fatalf("file a listener of the node netns: %v", err)
	}

	st, err := d.ResyncListeners(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Refiled != 1 || st.Pruned != 1 || st.NotEnrolled != 0 || len(st.Missing) != 0 {
		t.Errorf("resync: %+v; want the pod's listener filed again and the other entry pruned", st)
	}
	inboundThroughZtunnel(t, p, zt, n.StartApp(p), n.StartOutsideApp())
}

// startWithZtunnel loads the data path on the node and starts ztunnel's
// stand-in.
func startWithZtunnel(t *testing.T, n *simnode.Node) (*dataplane.Dataplane, *simnode.Ztunnel) {
	t.Helper()
	d, err := dataplane.New(ebpfConfig(n))
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	return d, n.StartZtunnel()
}

// enrollAndHand adds a pod, enrolls it as a CNI ADD does (before its
// containers run) and hands it to ztunnel, which listens in it then.
func enrollAndHand(t *testing.T, n *simnode.Node, d *dataplane.Dataplane, zt *simnode.Ztunnel, name string) *simnode.Pod {
	t.Helper()
	p := n.AddPod(name)
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: p.UID, Namespace: p.Namespace, Name: p.Name, Netns: p.NetnsPath(), IPs: p.IPs()}); err != nil {
		t.Fatal(err)
	}
	zt.Add(p)
	return p
}
