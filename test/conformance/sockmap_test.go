// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package conformance

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
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
	cfg      dataplane.Config
	d        *dataplane.Dataplane
}

func newAccelNode(t *testing.T, mode accel.Mode) *accelNode {
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
	e.d, e.cfg = d, cfg
	e.zt = n.StartZtunnel()
	e.zt.Add(e.a)
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: e.a.UID, Namespace: e.a.Namespace, Name: e.a.Name, Netns: e.a.NetnsPath(), IPs: e.a.IPs()}); err != nil {
		t.Fatal(err)
	}
	e.app, e.out = n.StartApp(e.a), n.StartOutsideApp()
	// Apps that splice (io.Copy between TCP connections) do not see bytes
	// redirected into them: with ztunnel's sends redirected too, the pod's
	// echo server reads and writes.
	e.listenEcho(t, e.app, accelEchoPort, simnode.AppRequest{ReadWrite: mode == accel.Both})
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

func (e *accelNode) stats(t *testing.T) accel.Stats {
	t.Helper()
	info, err := accel.Read(e.n.BPFFSDir)
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

// bulkRun is one bulk-tcp connection and the counters around it.
type bulkRun struct {
	resp          simnode.AppResponse
	before, after accel.Stats
	lo, loAfter   uint64
}

// bulk sends size bytes from one app to an echo server at dst and back.
// An end whose first send comes before its peer joined the sockhashes
// stays on TCP for good, by design (bytes must not overtake each other):
// the stats count it as plain. Under emulation (TCG, Linux 6.1) the
// app's first write can beat ztunnel's accept side to it; such a
// connection is tried again, up to twice, and logged.
func (e *accelNode) bulk(t *testing.T, from *simnode.App, dst netip.AddrPort, size int) bulkRun {
	t.Helper()
	var r bulkRun
	for try := 1; ; try++ {
		r.before, r.lo = e.stats(t), e.loBytes(t)
		var err error
		if r.resp, err = from.Do(simnode.AppRequest{Op: "bulk-tcp", Addr: dst, Bytes: size}); err != nil {
			t.Fatalf("bulk connection to %s: %v", dst, err)
		}
		r.after, r.loAfter = e.stats(t), e.loBytes(t)
		raced := r.after.Plain - r.before.Plain
		if raced == 0 || try == 3 {
			return r
		}
		t.Logf("try %d: %d end(s) sent before their peer joined (plain TCP by design); trying again", try, raced)
	}
}

// accelerates reports whether mode accelerates anything on this kernel:
// before Linux 5.15 every mode is the flag's fallback, plain TCP, and the
// tests below check that instead.
func accelerates(mode accel.Mode) bool { return mode.On() && features.HasSockmapAccel() }

// Real traffic both ways through the hop, in writes of up to 256 KiB,
// half-closed by the client: every byte arrives in order, and the pod's lo
// carries only what each mode leaves to TCP.
func TestAccelCarriesBulk(t *testing.T) {
	const size = 8 << 20
	for _, mode := range []accel.Mode{accel.Off, accel.ToZtunnel, accel.Both} {
		t.Run(string(mode), func(t *testing.T) {
			e := newAccelNode(t, mode)
			if st := e.d.AccelStatus(); st.Active != accelerates(mode) {
				t.Fatalf("status %+v for mode %s", st, mode)
			}
			// How many of the two directions skip TCP.
			redirected := map[accel.Mode]uint64{accel.Off: 0, accel.ToZtunnel: 1, accel.Both: 2}[mode]
			if !accelerates(mode) {
				redirected = 0
			}
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
					r := e.bulk(t, c.from, c.dst, size)
					resp, before, after, lo, loAfter := r.resp, r.before, r.after, r.lo, r.loAfter
					if resp.Echoed != size {
						t.Fatalf("echoed %d bytes, want %d", resp.Echoed, size)
					}
					if r, ok := e.zt.RecordFor(resp.Local); !ok || r.OrigDst != c.dst {
						t.Errorf("the connection did not go through ztunnel to %s: %+v", c.dst, r)
					}
					if got := after.RedirectBytes - before.RedirectBytes; got != redirected*size {
						t.Errorf("%d bytes redirected, want %d (%d directions)", got, redirected*size, redirected)
					}
					// TCP over lo adds headers (a few per cent at 64 KiB
					// segments) and the handshake; redirected bytes add
					// nothing. Under load the segments shrink and the ACKs
					// multiply (18% over was seen with the kernel legs
					// running beside make test): half of size still tells
					// one direction on TCP from two.
					onLo := loAfter - lo
					if want := (2 - redirected) * size; onLo < want || onLo > want+size/2 {
						t.Errorf("pod lo carried %d bytes, want %d plus TCP's overhead (%d of 2 directions on TCP)", onLo, want, 2-redirected)
					}
				})
			}
			if accelerates(mode) {
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
	info, err := accel.Read(n.BPFFSDir)
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
	var info accel.Info
	if !testenv.Poll(5*time.Second, func() bool {
		var err error
		if info, err = accel.Read(n.BPFFSDir); err != nil {
			t.Fatal(err)
		}
		return info.Senders+info.Receivers == 0
	}) {
		t.Fatalf("%d senders and %d receivers still in the sockmaps after their connections ended", info.Senders, info.Receivers)
	}
}

// Multipath TCP sockets cannot join a sockhash (an MPTCP subflow carries a
// ULP): a hop with one is left to TCP, and every byte still arrives. Go's
// listeners are MPTCP by default where the kernel allows, so an app's
// listener may well be one.
func TestAccelLeavesMPTCPToTCP(t *testing.T) {
	if fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_MPTCP); err != nil {
		// Debian 11's 5.10 is built without MPTCP: no app there can hold
		// an MPTCP socket, so there is nothing to leave to TCP.
		if errors.Is(err, unix.EPROTONOSUPPORT) {
			t.Logf("the kernel has no MPTCP (%v): every socket of a hop is TCP", err)
			return
		}
		t.Fatalf("MPTCP socket: %v", err)
	} else {
		unix.Close(fd)
	}
	const size = 1 << 20
	e := newAccelNode(t, accel.Both)
	const mptcpPort = accelEchoPort + 1
	e.listenEcho(t, e.app, mptcpPort, simnode.AppRequest{ReadWrite: true, MPTCP: true})
	for _, c := range []struct {
		name string
		from *simnode.App
		req  simnode.AppRequest
	}{
		{"mptcp_client", e.app, simnode.AppRequest{Addr: netip.AddrPortFrom(simnode.OutsideV4, accelEchoPort), MPTCP: true}},
		{"mptcp_listener", e.out, simnode.AppRequest{Addr: netip.AddrPortFrom(e.a.V4, mptcpPort)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := e.stats(t)
			c.req.Op, c.req.Bytes = "bulk-tcp", size
			resp, err := c.from.Do(c.req)
			if err != nil {
				t.Fatal(err)
			}
			if resp.Echoed != size {
				t.Fatalf("echoed %d bytes, want %d", resp.Echoed, size)
			}
			if r, ok := e.zt.RecordFor(resp.Local); !ok || r.OrigDst != c.req.Addr {
				t.Errorf("the connection did not go through ztunnel to %s: %+v", c.req.Addr, r)
			}
			after := e.stats(t)
			redirected := after.RedirectBytes - before.RedirectBytes
			switch c.name {
			case "mptcp_client":
				// The app's end was refused; ztunnel's found no peer.
				if accelerates(accel.Both) && after.InsertErrors == before.InsertErrors || redirected != 0 {
					t.Errorf("an MPTCP client's hop was not left to TCP: counters before %+v, after %+v", before, after)
				}
			default:
				// An MPTCP listener answers a TCP client (ztunnel) with a
				// TCP socket, which may join; a direction is redirected
				// whole or not at all.
				if redirected != 0 && redirected != size && redirected != 2*size {
					t.Errorf("%d bytes of %d each way redirected: a direction took both ways", redirected, size)
				}
				t.Logf("%d of %d bytes redirected", redirected, 2*size)
			}
		})
	}
}

// The flag never costs the data path: on a kernel without the helpers the
// acceleration needs, or when its programs or maps cannot be loaded (here a
// foreign map pinned where ae_accel goes), the agent starts, says why, and
// the hop is TCP.
func TestAccelFallsBack(t *testing.T) {
	n := simnode.New(t)
	a := n.AddPod("a")
	cfg := ebpfConfig(n)
	cfg.SockmapAccel = accel.Both
	var foreign *ebpf.Map
	if features.HasSockmapAccel() {
		var err error
		foreign, err = ebpf.NewMap(&ebpf.MapSpec{Name: "not_accel", Type: ebpf.Hash, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer foreign.Close()
		if err := os.MkdirAll(filepath.Join(cfg.BPFFSDir, "maps"), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := foreign.Pin(filepath.Join(cfg.BPFFSDir, "maps", "ae_accel")); err != nil {
			t.Fatal(err)
		}
	}
	d, err := dataplane.New(cfg)
	if err != nil {
		t.Fatalf("New with the acceleration unavailable: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	st := d.AccelStatus()
	if st.Active || st.Reason == "" || st.Mode != accel.Both {
		t.Errorf("status %+v, want inactive with a reason", st)
	}
	t.Logf("status: %+v", st)
	pins, _ := filepath.Glob(filepath.Join(cfg.BPFFSDir, "*", "*accel*"))
	wantPins := 0
	if foreign != nil {
		wantPins = 1 // the foreign map, left alone
	}
	if len(pins) != wantPins {
		t.Errorf("pins after the failed start: %v, want %d", pins, wantPins)
	}
	zt := n.StartZtunnel()
	zt.Add(a)
	if err := d.Enroll(context.Background(), dataplane.Pod{UID: a.UID, Namespace: a.Namespace, Name: a.Name, Netns: a.NetnsPath(), IPs: a.IPs()}); err != nil {
		t.Fatal(err)
	}
	app, out := n.StartApp(a), n.StartOutsideApp()
	if _, err := out.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), accelEchoPort)}); err != nil {
		t.Fatal(err)
	}
	dst := netip.AddrPortFrom(simnode.OutsideV4, accelEchoPort)
	resp, err := app.Do(simnode.AppRequest{Op: "bulk-tcp", Addr: dst, Bytes: 1 << 20})
	if err != nil || resp.Echoed != 1<<20 {
		t.Fatalf("bulk through ztunnel: echoed %d bytes, %v", resp.Echoed, err)
	}
	if r, ok := zt.RecordFor(resp.Local); !ok || r.OrigDst != dst {
		t.Errorf("the connection did not go through ztunnel: %+v", r)
	}
}

// restart stops the agent's data path (its pins stay) and starts it again
// in mode, as an agent restarted with --sockmap-accel=mode.
func (e *accelNode) restart(t *testing.T, mode accel.Mode) {
	t.Helper()
	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	cfg := e.cfg
	cfg.SockmapAccel = mode
	d, err := dataplane.New(cfg)
	if err != nil {
		t.Fatalf("restart with --sockmap-accel=%s: %v", mode, err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	e.d = d
	if got := d.List(); len(got) != 1 || got[0].UID != e.a.UID {
		t.Fatalf("restarted agent adopted %+v", got)
	}
}

// A connection accelerated by one agent keeps working, and keeps its
// sockmap path, while no agent runs and under the next one, whatever the
// next one's flag: turning the flag off stops accelerating new
// connections only (taking a socket out of a sockhash would drop what
// was redirected to it and not yet read). Once the last accelerated
// connection is gone, an agent with the flag off removes the rest.
func TestAccelSurvivesRestartsAndToggles(t *testing.T) {
	// Before 5.15 the flag changes nothing, restarts and toggles included.
	on := accelerates(accel.Both)
	e := newAccelNode(t, accel.Both)
	dst := netip.AddrPortFrom(simnode.OutsideV4, accelEchoPort)
	if _, err := e.app.Do(simnode.AppRequest{Op: "stream-open", Name: "s", Addr: dst}); err != nil {
		t.Fatal(err)
	}
	// echo sends a line on the long-lived connection and reports whether
	// both its directions went through the sockmap.
	echo := func(phase string) {
		t.Helper()
		before := e.stats(t)
		if _, err := e.app.Do(simnode.AppRequest{Op: "stream-echo", Name: "s", DNSName: phase}); err != nil {
			t.Fatalf("%s: the long-lived connection broke: %v", phase, err)
		}
		if got := e.stats(t).RedirectMsgs - before.RedirectMsgs; on && got < 2 || !on && got != 0 {
			t.Errorf("%s: %d of the line's two sends went through the sockmap", phase, got)
		}
	}
	// fresh runs a new connection and reports how many of its bytes were
	// redirected, want where the kernel has the acceleration.
	fresh := func(phase string, want uint64) {
		t.Helper()
		r := e.bulk(t, e.app, dst, 1<<20)
		if r.resp.Echoed != 1<<20 {
			t.Fatalf("%s: new connection: echoed %d bytes, want %d", phase, r.resp.Echoed, 1<<20)
		}
		if !on {
			want = 0
		}
		got := r.after.RedirectBytes - r.before.RedirectBytes
		// Known defect, left for issue 15: before Linux 6.10 (the sk_msg
		// program attached to the map, no link) one direction of a new
		// connection has gone back to TCP once the agent is gone (6.1
		// under vmtest). Falling back to TCP loses nothing; the bytes
		// still arrive (checked above).
		if phase == "agent-gone" && !features.HasSockmapLink() && got == want/2 {
			t.Logf("%s: %d bytes of a new connection redirected, want %d: one direction back on TCP (sk_msg without a link, known)", phase, got, want)
			return
		}
		if got != want {
			t.Errorf("%s: %d bytes of a new connection redirected, want %d", phase, got, want)
		}
	}
	accelPins := func() []string {
		pins, _ := filepath.Glob(filepath.Join(e.n.BPFFSDir, "*", "*accel*"))
		return pins
	}

	echo("agent-running")
	if err := e.d.Close(); err != nil {
		t.Fatal(err)
	}
	echo("agent-gone")
	fresh("agent-gone", 2<<20)

	cfg := e.cfg
	d, err := dataplane.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	e.d = d
	if st := d.AccelStatus(); st.Active != on {
		t.Fatalf("restarted with the flag on: %+v", st)
	}
	echo("agent-restarted")
	fresh("agent-restarted", 2<<20)

	e.restart(t, accel.Off)
	if st := e.d.AccelStatus(); st.Active || st.Mode != accel.Off {
		t.Errorf("restarted with the flag off: %+v", st)
	}
	if info, err := accel.Read(e.n.BPFFSDir); err != nil || info.Active || info.Installed != on {
		t.Errorf("flag off with an accelerated connection open: pins %+v (%v), want the maps without the sockops link", info, err)
	}
	echo("flag-off")
	fresh("flag-off", 0)

	if _, err := e.app.Do(simnode.AppRequest{Op: "stream-close", Name: "s"}); err != nil {
		t.Fatal(err)
	}
	waitAccelEmpty(t, e.n)
	e.restart(t, accel.Off)
	if pins := accelPins(); len(pins) != 0 {
		t.Errorf("flag off, nothing accelerated: pins %v left", pins)
	}
	fresh("removed", 0)

	e.restart(t, accel.ToZtunnel)
	if st := e.d.AccelStatus(); st.Active != on {
		t.Fatalf("flag on again: %+v", st)
	}
	fresh("on-again", 1<<20) // mode ztunnel: one direction
}

// ztunnel's delivery sockets take their ports from the pod's range; with
// no TIME_WAIT there and a narrow range, a delivery's 4-tuple comes back
// while the stand-in still holds the socket that had it, TCP-closed (its
// relay not yet done). Every connection must still get its own bytes: the
// sockhashes know sockets by cookie, and an accepted socket joins only as
// the proven peer of its own connecting end (ae_accel_pair). Keyed by
// 4-tuple, a send went into the dead socket and its connection stalled.
func TestAccelKeepsConnectionsApartWhenTuplesComeBack(t *testing.T) {
	const conns = 2000
	e := newAccelNode(t, accel.Both)
	e.n.Sysctl(e.a.NS, "net/ipv4/tcp_max_tw_buckets", "0")
	e.n.Sysctl(e.a.NS, "net/ipv4/ip_local_port_range", "47000 47063")
	before := e.stats(t)
	resp, err := e.out.Do(simnode.AppRequest{Op: "churn-tcp", Addr: netip.AddrPortFrom(e.a.V4, accelEchoPort), Count: conns})
	if err != nil {
		t.Fatal(err)
	}
	after := e.stats(t)
	t.Logf("%d redirected sends, %d ends unpaired, %d refused; %d connections could not connect (%s)", after.RedirectMsgs-before.RedirectMsgs,
		after.Unpaired-before.Unpaired, after.InsertErrors-before.InsertErrors, resp.ConnectFailures, resp.FirstError)
	if resp.Failures != 0 {
		t.Errorf("of %d connections through ztunnel into the pod, %d lost their bytes, the first: %s", conns, resp.Failures, resp.FirstError)
	}
	// 64 ports for eight connections at a time: ztunnel's delivery can
	// find none free (slow kernels under qemu), and ztunnel resets the
	// client. That is the port range, not the sockmap: allowed where
	// ztunnel recorded why.
	var relayErrors int64
	var firstRelayError string
	for _, r := range e.zt.Records() {
		if r.Error != "" {
			relayErrors++
			if firstRelayError == "" {
				firstRelayError = r.Error
			}
		}
	}
	// Under emulation (5.10 under qemu) a connect in the narrow range has
	// also failed once with no ztunnel record; a connection that connected
	// and lost bytes (above) is what the sockmap would cause.
	if resp.ConnectFailures > relayErrors+conns/100 {
		t.Errorf("%d of %d connections could not connect, but ztunnel failed only %d (%s); the first failure: %s",
			resp.ConnectFailures, conns, relayErrors, firstRelayError, resp.FirstError)
	}
	if accelerates(accel.Both) && after.RedirectMsgs == before.RedirectMsgs {
		t.Error("nothing went through the sockmap")
	}
}
