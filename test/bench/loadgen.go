// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The wire protocol between the load generator and the server: fixed-size
// messages whose first byte says what the server does after answering.
const (
	msgSize   = 64
	opClose   = 'c' // answer, then close (the server closes first)
	opKeep    = 'k' // answer and wait for more, or for the client to close
	bulkChunk = 128 << 10
)

// Ports the server listens on (inside the server pod).
const (
	echoPort = 7000
	sinkPort = 7001
)

// server answers echo requests on echoPort and swallows bulk data on
// sinkPort, replying with the byte count when the client is done.
type server struct{ ls []net.Listener }

type serverRequest struct {
	Op string `json:"op"` // listen
	// Base moves the echo and sink ports to Base and Base+1 (0: echoPort
	// and sinkPort), for servers that share a netns.
	Base int `json:"base,omitempty"`
}

func (s *server) handle(line []byte) (any, error) {
	req, err := decode[serverRequest](line)
	if err != nil {
		return nil, err
	}
	if req.Op != "listen" {
		return nil, fmt.Errorf("unknown op %q", req.Op)
	}
	// Go listens with MPTCP by default where the kernel allows; ztunnel
	// and the apps of a pod use plain TCP.
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	echo, sink := echoPort, sinkPort
	if req.Base != 0 {
		echo, sink = req.Base, req.Base+1
	}
	for port, serveConn := range map[int]func(net.Conn){echo: serveEcho, sink: serveSink} {
		l, err := lc.Listen(context.Background(), "tcp", fmt.Sprintf("[::]:%d", port))
		if err != nil {
			return nil, fmt.Errorf("listen on %d: %w", port, err)
		}
		s.ls = append(s.ls, l)
		go acceptLoop(l, serveConn)
	}
	return nil, nil
}

func (s *server) close() {
	for _, l := range s.ls {
		l.Close()
	}
}

func acceptLoop(l net.Listener, serveConn func(net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			serveConn(c)
		}()
	}
}

func serveEcho(c net.Conn) {
	buf := make([]byte, msgSize)
	for {
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		if _, err := c.Write(buf); err != nil || buf[0] == opClose {
			return
		}
	}
}

func serveSink(c net.Conn) {
	buf := make([]byte, bulkChunk)
	var total uint64
	for {
		n, err := c.Read(buf)
		total += uint64(n)
		if err != nil {
			break
		}
	}
	_, _ = c.Write(binary.BigEndian.AppendUint64(nil, total))
}

// client is the load generator in the client pod.
type client struct{}

// loadRequest is one measurement for the client.
type loadRequest struct {
	Op       string        `json:"op"` // conn, rr, bulk
	Addr     string        `json:"addr"`
	Duration time.Duration `json:"duration,omitempty"` // conn, bulk
	Conc     int           `json:"conc,omitempty"`     // conn: parallel loops
	Count    int           `json:"count,omitempty"`    // rr: round trips; conn: stop after this many connections (0: none)
	// Timeout bounds each connection of op conn, from the dial to the
	// response (0: 5 s).
	Timeout time.Duration `json:"timeout,omitempty"`
	// Storm counts failed connections of op conn and goes on, however
	// many fail (by default a loop whose connections mostly fail stops).
	Storm bool `json:"storm,omitempty"`
	// ServerCloses makes the server close each connection of op conn
	// first; by default the client closes first.
	ServerCloses bool `json:"serverCloses,omitempty"`
}

// loadResult is what the client measured.
type loadResult struct {
	Conns int64 `json:"conns,omitempty"` // connections completed
	// Failures counts connections of op conn that failed; FirstError is
	// the first failure.
	Failures   int64         `json:"failures,omitempty"`
	FirstError string        `json:"firstError,omitempty"`
	Elapsed    time.Duration `json:"elapsed"`
	Bytes      uint64        `json:"bytes,omitempty"`
	// Round-trip times of op rr, sorted.
	RTTs []time.Duration `json:"rtts,omitempty"`
	// Phases of op conn's successful connections, summed over them.
	Phases connPhases `json:"phases"`
}

// connPhases is where a connection's time goes: connect() until it
// returns (on a meshed path the handshake with the client pod's proxy),
// the request until its response is read (the proxies' upstream
// connections and both relays), and close() (with ServerCloses the
// wait for the server's FIN too).
type connPhases struct {
	Connect  time.Duration `json:"connect"`
	Exchange time.Duration `json:"exchange"`
	Close    time.Duration `json:"close"`
}

func (p *connPhases) add(o connPhases) {
	p.Connect, p.Exchange, p.Close = p.Connect+o.Connect, p.Exchange+o.Exchange, p.Close+o.Close
}

func (c *client) handle(line []byte) (any, error) {
	req, err := decode[loadRequest](line)
	if err != nil {
		return nil, err
	}
	switch req.Op {
	case "conn":
		return connLoop(req)
	case "rr":
		return roundTrips(req)
	case "bulk":
		return bulk(req)
	}
	return nil, fmt.Errorf("unknown op %q", req.Op)
}

// connLoop runs Conc loops of connect + request + response + close for
// Duration. A failed connection is counted and the loop goes on; a loop
// whose connections mostly fail stops, and so does the run when none
// succeeded at all.
func connLoop(req loadRequest) (loadResult, error) {
	conc := max(req.Conc, 1)
	timeout := req.Timeout
	if timeout == 0 {
		timeout = 5 * time.Second
	}
	var ok, failed, started atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	var mu sync.Mutex
	var phases connPhases
	start := time.Now()
	deadline := start.Add(req.Duration)
	for range conc {
		wg.Go(func() {
			buf := make([]byte, msgSize)
			var mine connPhases
			defer func() {
				mu.Lock()
				phases.add(mine)
				mu.Unlock()
			}()
			for time.Now().Before(deadline) && (req.Count == 0 || started.Add(1) <= int64(req.Count)) {
				ph, err := oneConn(req.Addr, buf, req.ServerCloses, timeout)
				if err != nil {
					once.Do(func() { firstErr = err })
					if f := failed.Add(1); !req.Storm && f > 100 && f > ok.Load() {
						return
					}
					continue
				}
				mine.add(ph)
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	res := loadResult{Conns: ok.Load(), Failures: failed.Load(), Elapsed: time.Since(start), Phases: phases}
	if firstErr != nil {
		res.FirstError = firstErr.Error()
	}
	if res.Conns == 0 && firstErr != nil {
		return res, fmt.Errorf("no connection succeeded: %w", firstErr)
	}
	return res, nil
}

// oneConn connects, sends one request, reads the response and closes,
// timing each.
func oneConn(addr string, buf []byte, serverCloses bool, timeout time.Duration) (connPhases, error) {
	var ph connPhases
	t0 := time.Now()
	deadline := t0.Add(timeout)
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return ph, err
	}
	t1 := time.Now()
	ph.Connect = t1.Sub(t0)
	_ = c.SetDeadline(deadline)
	buf[0] = opKeep
	if serverCloses {
		buf[0] = opClose
	}
	if _, err := c.Write(buf); err != nil {
		c.Close()
		return ph, fmt.Errorf("write: %w", err)
	}
	if _, err := io.ReadFull(c, buf); err != nil {
		c.Close()
		return ph, fmt.Errorf("read response: %w", err)
	}
	t2 := time.Now()
	ph.Exchange = t2.Sub(t1)
	if serverCloses {
		// Wait for the server's FIN, so the server side closes first.
		if n, err := c.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
			c.Close()
			return ph, fmt.Errorf("expected the server to close, got %d bytes, %v", n, err)
		}
	}
	c.Close()
	ph.Close = time.Since(t2)
	return ph, nil
}

// roundTrips times Count request/response exchanges on one connection
// (after a short warm-up).
func roundTrips(req loadRequest) (loadResult, error) {
	c, err := net.DialTimeout("tcp", req.Addr, 5*time.Second)
	if err != nil {
		return loadResult{}, err
	}
	defer c.Close()
	buf := make([]byte, msgSize)
	buf[0] = opKeep
	const warmup = 100
	rtts := make([]time.Duration, 0, req.Count)
	start := time.Now()
	_ = c.SetDeadline(start.Add(5*time.Second + time.Duration(req.Count)*time.Millisecond))
	for i := range req.Count + warmup {
		t0 := time.Now()
		if _, err := c.Write(buf); err != nil {
			return loadResult{}, fmt.Errorf("write: %w", err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			return loadResult{}, fmt.Errorf("read response: %w", err)
		}
		if i >= warmup {
			rtts = append(rtts, time.Since(t0))
		}
	}
	slices.Sort(rtts)
	return loadResult{Conns: 1, Elapsed: time.Since(start), RTTs: rtts}, nil
}

// bulk sends as fast as it can for Duration on one connection; the rate
// counts what the server received, up to its answer.
func bulk(req loadRequest) (loadResult, error) {
	c, err := net.DialTimeout("tcp", req.Addr, 5*time.Second)
	if err != nil {
		return loadResult{}, err
	}
	defer c.Close()
	buf := make([]byte, bulkChunk)
	start := time.Now()
	deadline := start.Add(req.Duration)
	_ = c.SetDeadline(deadline.Add(10 * time.Second))
	for time.Now().Before(deadline) {
		if _, err := c.Write(buf); err != nil {
			return loadResult{}, fmt.Errorf("write: %w", err)
		}
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return loadResult{}, err
	}
	var count [8]byte
	if _, err := io.ReadFull(c, count[:]); err != nil {
		return loadResult{}, fmt.Errorf("read byte count: %w", err)
	}
	return loadResult{Conns: 1, Elapsed: time.Since(start), Bytes: binary.BigEndian.Uint64(count[:])}, nil
}
