// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"bufio"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
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
func (n *Node) cgroup(name string) string {
	n.t.Helper()
	cg := filepath.Join(n.CgroupRoot, name)
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

// Ztunnel is the ztunnel stand-in process.
type Ztunnel struct {
	*Proc
	records string
}

// StartZtunnel starts the stand-in in the node netns, in its own cgroup
// below the node's cgroup root (as ztunnel's pod would be).
func (n *Node) StartZtunnel() *Ztunnel {
	n.t.Helper()
	cg := n.cgroup("ztunnel")
	records := filepath.Join(n.t.TempDir(), "ztunnel-records.jsonl")
	return &Ztunnel{Proc: StartHelper(n.t, RoleZtunnel, n.NodeNS, cg, RecordsEnv+"="+records), records: records}
}

// Add hands the pod to the stand-in, as an AddWorkload would.
func (z *Ztunnel) Add(p *Pod) {
	z.t.Helper()
	var resp AppResponse
	if err := z.Call(ZtunnelRequest{Op: "add", UID: p.UID, Netns: p.NetnsPath()}, &resp); err != nil || !resp.OK {
		z.t.Fatalf("ztunnel add %s: %v %s", p.Name, err, resp.Err)
	}
}

// Del takes the pod away from the stand-in.
func (z *Ztunnel) Del(p *Pod) {
	z.t.Helper()
	var resp AppResponse
	if err := z.Call(ZtunnelRequest{Op: "del", UID: p.UID}, &resp); err != nil || !resp.OK {
		z.t.Fatalf("ztunnel del %s: %v %s", p.Name, err, resp.Err)
	}
}

// RecordFor returns the record of the connection whose client was peer,
// waiting briefly for it to be written; ok is false when there is none.
func (z *Ztunnel) RecordFor(peer netip.AddrPort) (standin.Record, bool) {
	deadline := time.Now().Add(50 * time.Millisecond)
	for {
		for _, r := range z.Records() {
			if r.Peer == peer {
				return r, true
			}
		}
		if time.Now().After(deadline) {
			return standin.Record{}, false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Records returns every record so far.
func (z *Ztunnel) Records() []standin.Record {
	f, err := os.Open(z.records)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []standin.Record
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r standin.Record
		if json.Unmarshal(sc.Bytes(), &r) == nil {
			out = append(out, r)
		}
	}
	return out
}
