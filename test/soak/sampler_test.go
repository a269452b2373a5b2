// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// sampler makes new connections all the time: inbound to every pod from
// the outside host, outbound from the meshed and the plain fixed pods, and
// an echo on a long stream from each meshed fixed pod. Each connection is
// judged by the state its pod was in, unchanged, from before its dial to
// after: meshed, it must have passed ztunnel on the right listener with its
// original destination (0 bypass); plain, ztunnel must not have seen it.
type sampler struct {
	s    *soak
	stop chan struct{}
	wg   sync.WaitGroup

	mu       sync.Mutex
	counts   map[string]int
	viol     []string
	plains   []plainSample
	firstErr map[string]string
	lost     []string
}

type plainSample struct {
	what      string
	peer, dst netip.AddrPort
	start     time.Time
}

// recordWait bounds how long a meshed pod's connection may take to show
// in the stand-in's records before it counts as a bypass.
const recordWait = 3 * time.Second

func (s *soak) startSampler() *sampler {
	sm := &sampler{s: s, stop: make(chan struct{}), counts: map[string]int{}, firstErr: map[string]string{}}
	streams := map[string]time.Time{} // the fixed meshed pods' streams, by pod: opened
	sm.wg.Go(func() {
		for round := 0; ; round++ {
			select {
			case <-sm.stop:
				return
			default:
			}
			s.mu.Lock()
			pods := slices.Clone(s.pods)
			s.mu.Unlock()
			for _, p := range pods {
				sm.samplePod(p, round, streams)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return sm
}

func family(round int, p *simnode.Pod) (dst netip.Addr, outside netip.Addr, name string) {
	if round%2 == 0 {
		return p.V4, simnode.OutsideV4, "ipv4"
	}
	return p.V6, simnode.OutsideV6, "ipv6"
}

func (sm *sampler) samplePod(p *pod, round int, streams map[string]time.Time) {
	s := sm.s
	s.mu.Lock()
	app, gone, state, epoch := p.app, p.gone, p.state, p.epoch
	s.mu.Unlock()
	if gone || app == nil {
		return
	}
	dst, outside, fam := family(round, p.sp)
	kind := "churn"
	if p.stable {
		kind = "fixed"
	}
	// Inbound, from the outside host.
	in := netip.AddrPortFrom(dst, appPort)
	f := s.fault()
	resp, err := s.out.Dial("tcp", simnode.AppRequest{Addr: in})
	sm.judge(p, state, epoch, f, kind+" "+state+" inbound "+fam, resp, err, standin.InboundPort, in)
	if !p.stable {
		return
	}
	// Outbound, from the pod.
	to := netip.AddrPortFrom(outside, appPort)
	f = s.fault()
	resp, err = app.Dial("tcp", simnode.AppRequest{Addr: to})
	sm.judge(p, state, epoch, f, kind+" "+state+" outbound "+fam, resp, err, standin.OutboundPort, to)
	// DNS, to the outside host's server.
	server := netip.AddrPortFrom(outside, 53)
	f = s.fault()
	resp, err = app.Do(simnode.AppRequest{Op: "dns", Addr: server, Proto: "udp",
		DNSName: fmt.Sprintf("s%d-%s.%s", round, p.name, simnode.KnownDNSSuffix)})
	sm.judgeDNS(p, state, epoch, f, kind+" "+state+" dns "+fam, resp, err, server)
	if state == meshed {
		sm.stream(p, app, streams)
	}
}

// judge counts a connection's outcome and records a violation.
//
// A connection that failed is counted by the fault under way (its
// ztunnel's restart closes the listeners it waited in); one to or from a
// meshed pod with no fault of ztunnel under way is lost, and counted apart
// (lostAllowed).
func (sm *sampler) judge(p *pod, state string, epoch int, fault fault, what string, resp simnode.AppResponse, err error, port int, dst netip.AddrPort) {
	if !sm.settled(p, state, epoch, fault, what, dst.String(), err) {
		return
	}
	rec, ok := sm.lookup(resp.Local, resp.Start, state != plain)
	// What the server saw is the ground truth: a connection that went
	// straight to it shows the client's own address and port; one
	// ztunnel relayed shows ztunnel's socket (another port).
	direct := resp.Reply != nil && resp.Reply.Peer == resp.Local
	switch {
	case (state == meshed || state == pending) && !ok && direct:
		sm.violate("%s %s from %s to %s: bypassed ztunnel (pod %s %s; no record of any stand-in; the server saw %+v)", time.Now().Format("15:04:05.000"), what, resp.Local, dst, p.name, state, resp.Reply)
	case (state == meshed || state == pending) && !ok:
		// Relayed, but no stand-in's record names it: the harness's.
		sm.count(what+" relayed, no record found", fmt.Sprintf("from %s to %s at %s, the server saw %+v", resp.Local, dst, resp.Start.Format("15:04:05.000"), resp.Reply))
	case (state == meshed || state == pending) && (rec.Listener != port || rec.OrigDst != dst):
		sm.violate("%s %s from %s to %s: reached ztunnel on :%d for %s, want :%d for %s", time.Now().Format("15:04:05.000"), what, resp.Local, dst, rec.Listener, rec.OrigDst, port, dst)
	case state == plain && ok:
		sm.violate("%s %s from %s to %s: captured although pod %s is out of the mesh: %+v", time.Now().Format("15:04:05.000"), what, resp.Local, dst, p.name, rec)
	case state == plain && !direct:
		sm.violate("%s %s from %s to %s: relayed although pod %s is out of the mesh (the server saw %+v)", time.Now().Format("15:04:05.000"), what, resp.Local, dst, p.name, resp.Reply)
	case state == plain:
		sm.mu.Lock()
		sm.plains = append(sm.plains, plainSample{what, resp.Local, dst, resp.Start})
		sm.mu.Unlock()
		sm.count(what+" direct", "")
	default:
		sm.count(what+" via ztunnel", "")
	}
}

// settled counts a connection made while its pod moved, or that failed,
// and says whether it is left to judge.
func (sm *sampler) settled(p *pod, state string, epoch int, fault fault, what, dst string, err error) bool {
	s := sm.s
	s.mu.Lock()
	same := p.epoch == epoch && p.state == state
	during := s.active
	s.mu.Unlock()
	if fault == "" {
		fault = during
	}
	switch {
	case !same || state == moving:
		sm.count(what+" while moving", "")
		return false
	case err != nil && state == pending:
		sm.count(what+" failed while ztunnel has not acked the pod", err.Error())
		return false
	case err != nil && (fault == ztunnelRoll || fault == ztunnelCrash || fault == ztunnelFlaky):
		sm.count(what+" failed during "+string(fault), err.Error())
		return false
	case err != nil:
		sm.count(what+" lost", err.Error())
		sm.mu.Lock()
		sm.lost = append(sm.lost, fmt.Sprintf("%s %s to %s (fault under way: %q): %v", time.Now().Format("15:04:05.000"), what, dst, fault, err))
		sm.mu.Unlock()
		return false
	}
	return true
}

// judgeDNS judges a query for a name ztunnel's DNS proxy knows: a meshed
// pod's is answered by ztunnel, a plain pod's by the server it asked.
func (sm *sampler) judgeDNS(p *pod, state string, epoch int, fault fault, what string, resp simnode.AppResponse, err error, server netip.AddrPort) {
	if !sm.settled(p, state, epoch, fault, what, server.String(), err) {
		return
	}
	s := sm.s
	s.mu.Lock()
	lax, b, off := s.dnsLax, s.running, p.dnsOff
	s.mu.Unlock()
	switch {
	case state != plain && off && resp.Answer != simnode.OutsideDNSAnswer:
		sm.violate("%s %s to %s: answered %s, not by the server asked (pod %s's DNS capture is off)", time.Now().Format("15:04:05.000"), what, server, resp.Answer, p.name)
	case state != plain && off:
		sm.count(what+" direct (capture off)", "")
	case state != plain && resp.Answer != simnode.KnownDNSAnswer && lax && p.nsOnly:
		sm.count(what+" around ztunnel while "+b.name+" runs or HEAD restores (v0.1.0's restart defect)", "")
	case state != plain && resp.Answer != simnode.KnownDNSAnswer:
		sm.violate("%s %s to %s: answered %s, not by ztunnel (pod %s meshed)", time.Now().Format("15:04:05.000"), what, server, resp.Answer, p.name)
	case state == plain && resp.Answer != simnode.OutsideDNSAnswer:
		sm.violate("%s %s to %s: answered %s, not by the server asked (pod %s out of the mesh)", time.Now().Format("15:04:05.000"), what, server, resp.Answer, p.name)
	case state == plain:
		sm.count(what+" direct", "")
	default:
		sm.count(what+" via ztunnel", "")
	}
}

// lookup finds the record of the connection from peer made at or after
// start in the stand-ins alive then; with wait, for up to recordWait.
func (sm *sampler) lookup(peer netip.AddrPort, start time.Time, wait bool) (standin.Record, bool) {
	deadline := time.Now().Add(recordWait)
	for {
		sm.s.mu.Lock()
		var zts []*ztRun
		for _, z := range sm.s.zts {
			if z.gone.IsZero() || z.gone.After(start) {
				zts = append(zts, z)
			}
		}
		sm.s.mu.Unlock()
		for _, z := range zts {
			if r, ok := z.z.RecordSince(peer, start); ok {
				return r, true
			}
		}
		if !wait || time.Now().After(deadline) {
			return standin.Record{}, false
		}
	}
}

// stream echoes on the pod's long stream through ztunnel, opening it when
// there is none. A stream may end only with the stand-in that carried it.
func (sm *sampler) stream(p *pod, app *simnode.App, streams map[string]time.Time) {
	s := sm.s
	opened, ok := streams[p.name]
	if !ok {
		to := netip.AddrPortFrom(simnode.OutsideV4, echoPort)
		t0 := time.Now()
		resp, err := app.Do(simnode.AppRequest{Op: "stream-open", Name: "soak", Addr: to})
		if err != nil {
			sm.count("stream open failed", err.Error())
			return
		}
		if _, ok := sm.lookup(resp.Local, t0, true); !ok {
			sm.violate("the stream of %s from %s bypassed ztunnel", p.name, resp.Local)
		}
		streams[p.name] = time.Now()
		return
	}
	if _, err := app.Do(simnode.AppRequest{Op: "stream-echo", Name: "soak", DNSName: time.Now().Format(time.RFC3339Nano)}); err != nil {
		delete(streams, p.name)
		_, _ = app.Do(simnode.AppRequest{Op: "stream-close", Name: "soak"})
		s.mu.Lock()
		// A stopping stand-in closes its streams before its process
		// has exited.
		ztGone := slices.ContainsFunc(s.zts, func(z *ztRun) bool { return !z.stopping.IsZero() && z.stopping.After(opened) })
		s.mu.Unlock()
		if ztGone {
			sm.count("stream ended with its ztunnel", "")
			return
		}
		sm.violate("%s the stream of %s through ztunnel broke, and no ztunnel stopped since it opened at %s: %v", time.Now().Format("15:04:05.000"), p.name, opened.Format("15:04:05.000"), err)
		return
	}
	sm.count("stream echo", "")
}

// lateCaptures checks the plain pods' connections again against every
// record written since: a record written after lookup gave up is still a
// capture.
func (sm *sampler) lateCaptures(s *soak) {
	byPeer := map[netip.AddrPort][]standin.Record{}
	s.mu.Lock()
	zts := slices.Clone(s.zts)
	s.mu.Unlock()
	for _, z := range zts {
		for _, r := range z.z.Records() {
			byPeer[r.Peer] = append(byPeer[r.Peer], r)
		}
	}
	sm.mu.Lock()
	plains := slices.Clone(sm.plains)
	sm.mu.Unlock()
	for _, c := range plains {
		// Client ports come back: the record must be of this
		// destination, and soon after the dial.
		for _, r := range byPeer[c.peer] {
			if r.OrigDst == c.dst && !r.Time.Before(c.start) && r.Time.Before(c.start.Add(5*time.Second)) {
				sm.violate("%s from %s to %s: captured although its pod was out of the mesh (record at %s)", c.what, c.peer, c.dst, r.Time.Format("15:04:05.000"))
			}
		}
	}
}

func (sm *sampler) count(key, errText string) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	sm.counts[key]++
	if errText != "" && sm.firstErr[key] == "" {
		sm.firstErr[key] = errText
	}
}

func (sm *sampler) violate(format string, args ...any) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	sm.counts["violation"]++
	if len(sm.viol) < 20 {
		sm.viol = append(sm.viol, fmt.Sprintf(format, args...))
	}
}

func (sm *sampler) violations() []string {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return slices.Clone(sm.viol)
}

// outcomes are the samples by what and outcome, and the first error of
// each kind of failure.
func (sm *sampler) outcomes() map[string]string {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	out := map[string]string{}
	for k, n := range sm.counts {
		out[k] = fmt.Sprint(n)
		if e := sm.firstErr[k]; e != "" {
			out[k] += " (first: " + e + ")"
		}
	}
	return out
}

// lostAllowed is the share of the connections that may be lost (failed
// with no fault of ztunnel under way) before the soak fails: the simulated
// node's own rare losses (see test/takeover's lostInbound), never a
// bypass.
const lostAllowed = 1.0 / 500

// checkLost fails the soak when more connections were lost than
// lostAllowed, and lists them.
func (sm *sampler) checkLost(s *soak) {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	total := 0
	for k, n := range sm.counts {
		if k != "violation" && !strings.HasPrefix(k, "stream") {
			total += n
		}
	}
	switch {
	case float64(len(sm.lost)) > lostAllowed*float64(total):
		s.fail("%d of %d connections lost with no fault of ztunnel under way, more than %.1f%%:\n%s", len(sm.lost), total, lostAllowed*100, strings.Join(sm.lost, "\n"))
	case len(sm.lost) > 0:
		s.t.Logf("soak: %d of %d connections lost with no fault of ztunnel under way:\n%s", len(sm.lost), total, strings.Join(sm.lost, "\n"))
	}
}

func (sm *sampler) halt() {
	select {
	case <-sm.stop:
	default:
		close(sm.stop)
	}
	sm.wg.Wait()
}
