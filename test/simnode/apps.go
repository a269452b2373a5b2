// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

// App is an app helper process: it listens and dials on request.
type App struct{ *Proc }

// StartApp starts an app in the pod's netns and cgroup.
func (n *Node) StartApp(p *Pod) *App {
	return &App{StartHelper(n.t, RoleApp, p.NS, p.Cgroup)}
}

// StartOutsideApp starts an app on the outside host.
func (n *Node) StartOutsideApp() *App {
	return &App{StartHelper(n.t, RoleApp, n.OutsideNS, n.cgroup("outside"))}
}

// cgroup makes (once) a cgroup below the node's root for helpers that are
// not in a pod, so cleanup can end them however a test fails.
func (n *Node) cgroup(name string) string { return n.cgroupIn(n.CgroupRoot, name) }

// podsCgroup makes (once) a cgroup beside the pods', for a helper that is
// a pod on a real node (ztunnel).
func (n *Node) podsCgroup(name string) string { return n.cgroupIn(n.PodsCgroup, name) }

// ZtunnelCgroup is the cgroup the stand-in runs in, as ztunnel's pod's:
// below the pods' cgroup.
func (n *Node) ZtunnelCgroup() string { return n.podsCgroup("ztunnel") }

// PodsCgroupDir is a cgroup below the pods' cgroup, made if missing.
func (n *Node) PodsCgroupDir(name string) string { return n.podsCgroup(name) }

func (n *Node) cgroupIn(parent, name string) string {
	n.t.Helper()
	cg := filepath.Join(parent, name)
	if err := os.Mkdir(cg, 0o755); err != nil && !os.IsExist(err) {
		n.t.Fatal(err)
	}
	return cg
}

// StartNodeApp starts an app in the node netns, as kubelet would run:
// in a cgroup of the node's hierarchy, outside every pod.
func (n *Node) StartNodeApp() *App {
	return &App{StartHelper(n.t, RoleApp, n.NodeNS, n.cgroup("kubelet"))}
}

// StartVMApp starts an app behind a pod's virtual interface.
func (n *Node) StartVMApp(v *VM) *App {
	return &App{StartHelper(n.t, RoleApp, v.NS, n.cgroup("vm"))}
}

// Listen starts a TCP ("tcp") or UDP ("udp") server that answers with a
// standin.Reply naming itself and what it saw.
func (a *App) Listen(proto, name string, addr netip.AddrPort) {
	a.t.Helper()
	var resp AppResponse
	if err := a.Call(AppRequest{Op: "listen-" + proto, Name: name, Addr: addr}, &resp); err != nil || !resp.OK {
		a.t.Fatalf("listen %s %s: %v %s", proto, addr, err, resp.Err)
	}
}

// Dial connects (TCP or UDP), says hello and returns the server's reply.
func (a *App) Dial(proto string, req AppRequest) (AppResponse, error) {
	req.Op = "dial-" + proto
	var resp AppResponse
	if err := a.Call(req, &resp); err != nil {
		return resp, err
	}
	if !resp.OK {
		return resp, errors.New(resp.Err)
	}
	return resp, nil
}

// Ping sends one ICMP echo request and waits for the reply.
func (a *App) Ping(dst netip.Addr) error {
	var resp AppResponse
	if err := a.Call(AppRequest{Op: "ping", Addr: netip.AddrPortFrom(dst, 0)}, &resp); err != nil {
		return err
	}
	if !resp.OK {
		return errors.New(resp.Err)
	}
	return nil
}

// Do sends any request and fails on a transport error only.
func (a *App) Do(req AppRequest) (AppResponse, error) {
	var resp AppResponse
	if err := a.Call(req, &resp); err != nil {
		return resp, err
	}
	if !resp.OK {
		return resp, errors.New(resp.Err)
	}
	return resp, nil
}

// Ztunnel is the ztunnel stand-in process, fed over ZDS by a server in
// the test process that plays the node agent's part.
type Ztunnel struct {
	*Proc
	t          TB
	records    string
	transcript string // StartZtunnelFor's ZDS transcript
	zds        *zds.Server
	stopServer func()
	mu         sync.Mutex
	pods       map[string]zds.Workload

	// What of the records file is read so far: the records, and the
	// first of each client's.
	recMu   sync.Mutex
	recRead int64
	recAll  []standin.Record
	recPeer map[netip.AddrPort]standin.Record
}

// StartZtunnel starts the stand-in in the node netns, in its own cgroup
// below the node's cgroup root (as ztunnel's pod would be), connected
// over ZDS to a server this test runs.
func (n *Node) StartZtunnel() *Ztunnel {
	n.t.Helper()
	return n.StartZtunnelServedAt(filepath.Join(n.t.TempDir(), "ztunnel.sock"))
}

// StartZtunnelServedAt is StartZtunnel with the test's ZDS server at
// socketPath, where a node agent may take over later: StopServer ends the
// test's server (the stand-in keeps its pods and reconnects, as ztunnel
// does when its node agent is replaced).
func (n *Node) StartZtunnelServedAt(sock string) *Ztunnel {
	n.t.Helper()
	z := &Ztunnel{t: n.t, records: filepath.Join(n.t.TempDir(), "ztunnel-records.jsonl"), pods: map[string]zds.Workload{}}
	srv, err := zds.NewServer(zds.Config{SocketPath: sock, Snapshot: z.snapshot})
	if err != nil {
		n.t.Fatal(err)
	}
	z.zds = srv
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Run(ctx) }()
	var once sync.Once
	z.stopServer = func() { once.Do(func() { cancel(); <-done }) }
	n.t.Cleanup(z.stopServer)
	select {
	case <-srv.Ready():
	case <-time.After(5 * time.Second):
		n.t.Fatal("zds server did not start")
	}
	z.Proc = n.startZtunnelProc(z.records, sock)
	if !testenv.Poll(10*time.Second, func() bool { return srv.Connections() > 0 }) {
		n.t.Fatalf("the stand-in never connected over ZDS; stderr:\n%s", z.Stderr.String())
	}
	return z
}

// StopServer ends the test's ZDS server (StartZtunnelServedAt): its
// connection closes and its socket file goes; Add and Del fail after.
func (z *Ztunnel) StopServer() {
	if z.stopServer != nil {
		z.stopServer()
	}
}

// StartZtunnelFor starts the stand-in against an agent's ZDS socket: the
// agent, not the test, hands it pods. Add and Del are not available.
func (n *Node) StartZtunnelFor(socketPath string, extraEnv ...string) *Ztunnel {
	n.t.Helper()
	return n.StartZtunnelForIn(socketPath, n.ZtunnelCgroup(), extraEnv...)
}

// StartZtunnelForIn is StartZtunnelFor with the stand-in in cgroup (a
// ztunnel pod's that replaced the first, say).
func (n *Node) StartZtunnelForIn(socketPath, cgroup string, extraEnv ...string) *Ztunnel {
	n.t.Helper()
	dir := n.t.TempDir()
	z := &Ztunnel{t: n.t, records: filepath.Join(dir, "ztunnel-records.jsonl"), transcript: filepath.Join(dir, "zds-transcript.jsonl")}
	env := append([]string{RecordsEnv + "=" + z.records, ZDSSocketEnv + "=" + socketPath, TranscriptEnv + "=" + z.transcript}, extraEnv...)
	z.Proc = StartHelper(n.t, RoleZtunnel, n.NodeNS, cgroup, env...)
	return z
}

// DropZDS closes the stand-in's ZDS connection, its pods' listeners kept;
// it connects again, as ztunnel does.
func (z *Ztunnel) DropZDS() error {
	var resp AppResponse
	if err := z.Call(AppRequest{Op: "zds-drop"}, &resp); err != nil {
		return err
	}
	if !resp.OK {
		return errors.New(resp.Err)
	}
	return nil
}

// Transcript returns every ZDS request the stand-in received from the
// agent so far (StartZtunnelFor), in order, across its connections.
func (z *Ztunnel) Transcript() ([]zdsclient.Observed, error) {
	b, err := os.ReadFile(z.transcript)
	if err != nil {
		return nil, fmt.Errorf("read zds transcript: %w", err)
	}
	var out []zdsclient.Observed
	// A line being written is left out.
	for line := range bytes.Lines(b[:bytes.LastIndexByte(b, '\n')+1]) {
		var o zdsclient.Observed
		if err := json.Unmarshal(line, &o); err != nil {
			return nil, fmt.Errorf("zds transcript %s: %w", z.transcript, err)
		}
		out = append(out, o)
	}
	return out, nil
}

func (n *Node) startZtunnelProc(records, socket string, extraEnv ...string) *Proc {
	env := append([]string{RecordsEnv + "=" + records, ZDSSocketEnv + "=" + socket}, extraEnv...)
	return StartHelper(n.t, RoleZtunnel, n.NodeNS, n.ZtunnelCgroup(), env...)
}

func (z *Ztunnel) snapshot() []zds.Workload {
	z.mu.Lock()
	defer z.mu.Unlock()
	out := make([]zds.Workload, 0, len(z.pods))
	for _, w := range z.pods {
		out = append(out, w)
	}
	return out
}

// Add hands the pod to the stand-in with an AddWorkload.
func (z *Ztunnel) Add(p *Pod) {
	z.t.Helper()
	w := zds.Workload{UID: p.UID, Name: p.Name, Namespace: p.Namespace, ServiceAccount: "default", Netns: p.NetnsPath()}
	z.mu.Lock()
	z.pods[p.UID] = w
	z.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := z.zds.AddWorkload(ctx, w); err != nil {
		z.t.Fatalf("ztunnel add %s: %v; stderr:\n%s", p.Name, err, z.Stderr.String())
	}
}

// Del takes the pod away from the stand-in with a DelWorkload.
func (z *Ztunnel) Del(p *Pod) {
	z.t.Helper()
	z.mu.Lock()
	delete(z.pods, p.UID)
	z.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := z.zds.DelWorkload(ctx, p.UID); err != nil {
		z.t.Fatalf("ztunnel del %s: %v", p.Name, err)
	}
}

// RecordFor returns the record of the connection whose client was peer,
// waiting briefly for it to be written; ok is false when there is none.
// It is the first of peer's: where client ports come back, RecordSince
// tells connections apart.
func (z *Ztunnel) RecordFor(peer netip.AddrPort) (standin.Record, bool) {
	return z.waitRecord(func() (standin.Record, bool) {
		r, ok := z.recPeer[peer]
		return r, ok
	})
}

// RecordSince is RecordFor for the connection from peer made at or after
// since (an AppResponse's Start): not an earlier one from the same port.
func (z *Ztunnel) RecordSince(peer netip.AddrPort, since time.Time) (standin.Record, bool) {
	return z.waitRecord(func() (standin.Record, bool) {
		i := slices.IndexFunc(z.recAll, func(r standin.Record) bool { return r.Peer == peer && !r.Time.Before(since) })
		if i < 0 {
			return standin.Record{}, false
		}
		return z.recAll[i], true
	})
}

// waitRecord reads the records and looks one up with find (under recMu)
// until it is there or 50 ms went by.
func (z *Ztunnel) waitRecord(find func() (standin.Record, bool)) (standin.Record, bool) {
	var r standin.Record
	var ok bool
	testenv.Poll(50*time.Millisecond, func() bool {
		z.readRecords()
		z.recMu.Lock()
		defer z.recMu.Unlock()
		r, ok = find()
		return ok
	})
	return r, ok
}

// Records returns every record so far.
func (z *Ztunnel) Records() []standin.Record {
	z.readRecords()
	z.recMu.Lock()
	defer z.recMu.Unlock()
	return slices.Clone(z.recAll)
}

// readRecords reads the records written since the last call: suites that
// sample for minutes look up thousands of connections.
func (z *Ztunnel) readRecords() {
	z.recMu.Lock()
	defer z.recMu.Unlock()
	f, err := os.Open(z.records)
	if err != nil {
		return
	}
	defer f.Close()
	b, err := io.ReadAll(io.NewSectionReader(f, z.recRead, 1<<62))
	if err != nil {
		return
	}
	// A line being written is left for the next call.
	b = b[:bytes.LastIndexByte(b, '\n')+1]
	z.recRead += int64(len(b))
	if z.recPeer == nil {
		z.recPeer = map[netip.AddrPort]standin.Record{}
	}
	for line := range bytes.Lines(b) {
		var r standin.Record
		if json.Unmarshal(line, &r) != nil {
			continue
		}
		z.recAll = append(z.recAll, r)
		if _, seen := z.recPeer[r.Peer]; !seen {
			z.recPeer[r.Peer] = r
		}
	}
}

// HTTPGet fetches url from inside netns ns (for an agent's health and
// metrics endpoints, which live in the node netns).
func HTTPGet(ns, url string) (int, string, error) {
	c, done, err := HTTPClient(ns)
	if err != nil {
		return 0, "", err
	}
	defer done()
	return Get(c, url)
}

// Get fetches url with c and returns the status code and body.
func Get(c *http.Client, url string) (int, string, error) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// HTTPClient returns a client that makes its connections inside netns ns,
// for polling an agent's endpoints, and what releases it.
func HTTPClient(ns string) (*http.Client, func(), error) {
	f, err := os.Open(NetnsPath(ns))
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	nsf, err := sockutil.EnterNetns(f)
	if err != nil {
		return nil, nil, err
	}
	// The transport dials on goroutines of its own: sockets must come from
	// the thread parked in the netns.
	dial := func(_ context.Context, _, addr string) (net.Conn, error) {
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			return nil, err
		}
		return nsf.Dial(ap, sockutil.Opts{}, 2*time.Second)
	}
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true, DialContext: dial}}
	return c, nsf.Close, nil
}
