// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package bench measures the direct path, the iptables reference and the
// eBPF data path side by side on one simulated node (issue 8). The
// measurements run as TestBench, which skips unless AMBIENT_EBPF_BENCH=1
// (`make bench` sets it), so `go test ./...` stays fast.
//
// The node runs the real agent binary (cmd/ambient-ebpf-agent, built for
// the run), which enrolls the eBPF pods through the real CNI plugin. The
// other moving parts are helper processes, the test binary re-executed in
// a role (simnode.StartHelper): a load generator in the client pod's netns
// and cgroup, a server in the server pod, the ztunnel stand-in in the node
// netns (also the ztunnel the agent talks ZDS to), the container runtime's
// side of CNI, which execs the plugins, and a process owning a dataplane
// of its own for timing the dataplane API. Each helper gets one JSON
// request per measurement and answers with the numbers, so the protocol
// costs nothing while the clock runs.
//go:build bench

package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Helper roles of this package.
const (
	roleClient  = "bench-client"
	roleServer  = "bench-server"
	roleZtunnel = "bench-ztunnel"
	roleAgent   = "bench-agent"
	roleRuntime = "bench-runtime"
	roleLean    = "bench-leanproxy"
	roleTracer  = "bench-tracer"
)

// RunHelper runs this package's helper role named in the environment, or
// simnode's, and exits; it returns when the process is no helper. Call it
// first thing in TestMain.
func RunHelper() {
	var h handler
	switch os.Getenv(simnode.HelperEnv) {
	case "":
		return
	case roleClient:
		h = &client{}
	case roleServer:
		h = &server{}
	case roleZtunnel:
		h = newZtunnel()
	case roleAgent:
		h = &agent{}
	case roleRuntime:
		h = cniRuntime{}
	case roleLean:
		h = &leanProxy{}
	case roleTracer:
		h = &tracer{}
	default:
		simnode.RunHelper()
		return
	}
	err := serve(h)
	if c, ok := h.(interface{ close() }); ok {
		c.close()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// handler answers one request line.
type handler interface {
	handle(line []byte) (any, error)
}

// reply is the envelope of every answer.
type reply struct {
	OK   bool            `json:"ok"`
	Err  string          `json:"err,omitempty"`
	Data json.RawMessage `json:"data,omitempty"`
}

// serve speaks simnode's helper protocol: {"Ready":true}, then one JSON
// line answered per line read, until stdin closes.
func serve(h handler) error {
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(map[string]bool{"Ready": true}); err != nil {
		return err
	}
	sc := bufio.NewScanner(os.Stdin)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		var r reply
		data, err := h.handle(sc.Bytes())
		if err == nil {
			r.Data, err = json.Marshal(data)
		}
		if err != nil {
			r.Err = err.Error()
		} else {
			r.OK = true
		}
		if err := enc.Encode(r); err != nil {
			return err
		}
	}
	return sc.Err()
}

// call sends req to a helper and decodes the answer's data into resp.
func call(p *simnode.Proc, req, resp any) error {
	var r reply
	if err := p.Call(req, &r); err != nil {
		return err
	}
	if !r.OK {
		return fmt.Errorf("%s", r.Err)
	}
	if resp == nil {
		return nil
	}
	return json.Unmarshal(r.Data, resp)
}

// decode unmarshals a request line.
func decode[T any](line []byte) (T, error) {
	var v T
	if err := json.Unmarshal(line, &v); err != nil {
		return v, fmt.Errorf("bad request: %w", err)
	}
	return v, nil
}
