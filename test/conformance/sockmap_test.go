// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/vishvananda/netlink"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

const accelEchoPort = 8090

// accelNode is one enrolled pod with ztunnel, an echo server in the pod
// and one outside.
type accelNode struct {
	n        *simnode.Node
	a        *simnode.Pod
	app, out *simnode.App
	zt       *simnode.Ztunnel
	d        *dataplane.Dataplane
}

func newAccelNode(t *testing.T, mode dataplane.AccelMode) *accelNode {
	t.Helper()
	n := simnode.New(t)
	e := &accelNode{n: n, a: n.AddPod("a")}
	cfg := ebpfConfig(n)
	cfg.SockmapAccel = mode
	d, err := dataplane.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	e.d = d
	e.zt = n.StartZtunnel()
	e.zt.Add(e.a)
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: e.a.UID, Namespace: e.a.Namespace, Name: e.a.Name, Netns: e.a.NetnsPath(), IPs: e.a.IPs()}); err != nil {
		t.Fatal(err)
	}
	e.app, e.out = n.StartApp(e.a), n.StartOutsideApp()
	// Apps that splice (io.Copy between TCP connections) do not see bytes
	// redirected into them: with ztunnel's sends redirected too, the pod's
	// echo server reads and writes.
	e.listenEcho(t, e.app, accelEchoPort, simnode.AppRequest{ReadWrite: mode == dataplane.AccelBoth})
	e.listenEcho(t, e.out, accelEchoPort, simnode.AppRequest{})
	return e
}

func (e *accelNode) listenEcho(t *testing.T, app *simnode.App, port uint16, req simnode.AppRequest) {
	t.Helper()
	req.Op, req.Addr = "listen-echo", netip.AddrPortFrom(netip.IPv6Unspecified(), port)
	if _, err := app.Do(req); err != nil {
		t.Fatal(err)
	}
}

func (e *accelNode) stats(t *testing.T) dataplane.AccelStats {
	t.Helper()
	info, err := dataplane.ReadAccel(e.n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	return info.Stats
}

// loBytes is what the pod's lo has carried: the hop between the app and
// ztunnel, where it is TCP.
func (e *accelNode) loBytes(t *testing.T) uint64 {
	t.Helper()
	var n uint64
	err := simnode.InNetns(e.a.NS, func() error {
		l, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		n = l.Attrs().Statistics.TxBytes
		return nil
	})
	if err != nil {
		t.Fatalf("read lo counters of pod %s: %v", e.a.Name, err)
	}
	return n
}

func requireAccel(t *testing.T) {
	t.Helper()
	if !features.HasSockmapAccel() {
		// Kernels before 5.15: checkAccelerated (TestConformance) and
		// TestAccelFallsBack cover them.
		testenv.SkipOrFail(t, "the kernel has no sockmap acceleration (Linux 5.15)")
	}
}

// Real traffic both ways through the hop, in writes of up to 256 KiB,
// half-closed by the client: every byte arrives in order, and the pod's lo
// carries only what each mode leaves to TCP.
func TestAccelCarriesBulk(t *testing.T) {
	requireAccel(t)
	const size = 8 << 20
	for _, mode := range []dataplane.AccelMode{dataplane.AccelOff, dataplane.AccelToZtunnel, dataplane.AccelBoth} {
		t.Run(string(mode), func(t *testing.T) {
			e := newAccelNode(t, mode)
			if st := e.d.AccelStatus(); st.Active != mode.On() {
				t.Fatalf("status %+v for mode %s", st, mode)
			}
			// How many of the two directions skip TCP.
			redirected := map[dataplane.AccelMode]uint64{dataplane.AccelOff: 0, dataplane.AccelToZtunnel: 1, dataplane.AccelBoth: 2}[mode]
			for _, c := range []struct {
				name string
				from *simnode.App
				dst  netip.AddrPort
			}{
				{"outbound_v4", e.app, netip.AddrPortFrom(simnode.OutsideV4, accelEchoPort)},
				{"outbound_v6", e.app, netip.AddrPortFrom(simnode.OutsideV6, accelEchoPort)},
				{"inbound_v4", e.out, netip.AddrPortFrom(e.a.V4, accelEchoPort)},
				{"inbound_v6", e.out, netip.AddrPortFrom(e.a.V6, accelEchoPort)},
			} {
				t.Run(c.name, func(t *testing.T) {
					before, lo := e.stats(t), e.loBytes(t)
					resp, err := c.from.Do(simnode.AppRequest{Op: "bulk-tcp", Addr: c.dst, Bytes: size})
					if err != nil {
						t.Fatal(err)
					}
					if resp.Echoed != size {
						t.Fatalf("echoed %d bytes, want %d", resp.Echoed, size)
					}
					if r, ok := e.zt.RecordFor(resp.Local); !ok || r.OrigDst != c.dst {
						t.Errorf("the connection did not go through ztunnel to %s: %+v", c.dst, r)
					}
					after, loAfter := e.stats(t), e.loBytes(t)
					if got := after.RedirectBytes - before.RedirectBytes; got != redirected*size {
						t.Errorf("%d bytes redirected, want %d (%d directions)", got, redirected*size, redirected)
					}
					// TCP over lo adds headers (a few per cent at 64 KiB
					// segments) and the handshake; redirected bytes add
					// nothing.
					onLo := loAfter - lo
					if want := (2 - redirected) * size; onLo < want || onLo > want+want/8+64<<10 {
						t.Errorf("pod lo carried %d bytes, want %d plus TCP's overhead (%d of 2 directions on TCP)", onLo, want, 2-redirected)
					}
				})
			}
			if mode.On() {
				waitAccelEmpty(t, e.n)
			}
		})
	}
}

// checkAccelerated runs after every row ran with the acceleration on: where
// the kernel has it, the rows' hops went through the sockmap and each
// socket left ae_accel with its connection; where it does not, the flag
// changed nothing and says why.
func checkAccelerated(t *testing.T, dp *dataplane.Dataplane, n *simnode.Node) {
	st := dp.AccelStatus()
	info, err := dataplane.ReadAccel(n.BPFFSDir)
	if err != nil {
		t.Fatal(err)
	}
	if !features.HasSockmapAccel() {
		if st.Active || st.Reason == "" || info.Installed {
			t.Errorf("no sockmap acceleration on this kernel, yet status %+v, pins %+v", st, info)
		}
		return
	}
	if !st.Active {
		t.Fatalf("acceleration requested and available, but not active: %+v", st)
	}
	s := info.Stats
	if s.Redirecting == 0 || s.RedirectBytes == 0 || s.InsertErrors != 0 {
		t.Errorf("the rows' hops did not go through the sockmap: %+v", s)
	}
	waitAccelEmpty(t, n)
}

// waitAccelEmpty waits until no socket is left in the acceleration's maps
// (the kernel drops each as it closes).
func waitAccelEmpty(t *testing.T, n *simnode.Node) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		info, err := dataplane.ReadAccel(n.BPFFSDir)
		if err != nil {
			t.Fatal(err)
		}
		if info.Senders+info.Receivers == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d senders and %d receivers still in the sockmaps after their connections ended", info.Senders, info.Receivers)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
