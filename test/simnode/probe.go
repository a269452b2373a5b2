// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
)

// TrafficProbe keeps redirected traffic going from an app while something
// happens to the agent: one long TCP stream that must never break, and a
// steady run of new connections that must each go through ztunnel.
type TrafficProbe struct {
	stop     atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	failures []string
	conns    atomic.Int64
}

// StartTrafficProbe opens a stream from app to echo (an echo server,
// op listen-echo) and dials dial again and again, checking each connection
// against zt's records.
func StartTrafficProbe(app *App, zt *Ztunnel, echo, dial netip.AddrPort) (*TrafficProbe, error) {
	if _, err := app.Do(AppRequest{Op: "stream-open", Name: "probe", Addr: echo}); err != nil {
		return nil, fmt.Errorf("open the stream: %w", err)
	}
	p := &TrafficProbe{}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for i := 0; !p.stop.Load(); i++ {
			resp, err := app.Dial("tcp", AppRequest{Addr: dial})
			if err != nil {
				p.fail("connection %d: %v", i, err)
				continue
			}
			p.conns.Add(1)
			if rec, ok := zt.RecordFor(resp.Local); !ok || rec.OrigDst != dial {
				p.fail("connection %d from %s bypassed ztunnel", i, resp.Local)
			}
			if _, err := app.Do(AppRequest{Op: "stream-echo", Name: "probe", DNSName: fmt.Sprintf("msg-%d", i)}); err != nil {
				p.fail("the stream broke: %v", err)
				return
			}
		}
	}()
	return p, nil
}

func (p *TrafficProbe) fail(format string, args ...any) {
	p.mu.Lock()
	p.failures = append(p.failures, fmt.Sprintf(format, args...))
	p.mu.Unlock()
}

// Conns is how many connections the probe made so far.
func (p *TrafficProbe) Conns() int { return int(p.conns.Load()) }

// Stop ends the probe and reports how many connections it made and what
// went wrong.
func (p *TrafficProbe) Stop() (conns int, failures []string) {
	p.stop.Store(true)
	p.wg.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	return int(p.conns.Load()), p.failures
}
