// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command testapp is the one static binary of the real-node suite's images
// (test/node): the pause process of every sandbox, the echo server and the
// client. Each mode prints what it saw as JSON lines on stdout, which the
// runtime writes to the container's log, or answers an exec.
//
//	testapp pause                          sleep until SIGTERM
//	testapp serve NAME TCPADDR HTTPADDR    TCP echo server and HTTP probe target
//	testapp dial ADDR                      one TCP exchange with an echo server
//	testapp dns NAME SERVER                one A query over UDP
//	testapp hold ADDR                      one connection, a line every 50 ms until SIGTERM
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"
)

// Reply is the first line the echo server writes on each connection: who
// answered and the addresses the server's socket has (the peer is the
// client as the receiving side sees it).
type Reply struct {
	Server string `json:"server"`
	Local  string `json:"local"`
	Peer   string `json:"peer"`
}

// Result is what dial, dns and hold print.
type Result struct {
	Reply *Reply   `json:"reply,omitempty"`
	Local string   `json:"local,omitempty"`
	Addrs []string `json:"addrs,omitempty"`
	Sent  int      `json:"sent,omitempty"`
	Err   string   `json:"err,omitempty"`
}

// Probe is what the server logs for each HTTP request it answers.
type Probe struct {
	Path string `json:"path"`
	Peer string `json:"peer"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testapp pause|serve|dial|dns|hold ...")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var err error
	args := os.Args[2:]
	switch os.Args[1] {
	case "pause":
		<-ctx.Done()
	case "serve":
		err = serve(ctx, args[0], args[1], args[2])
	case "dial":
		print(dial(args[0]))
	case "dns":
		print(dns(args[0], args[1]))
	case "hold":
		print(hold(ctx, args[0]))
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func print(v any) {
	b, _ := json.Marshal(v)
	fmt.Println(string(b))
}

func serve(ctx context.Context, name, tcpAddr, httpAddr string) error {
	l, err := net.Listen("tcp", tcpAddr)
	if err != nil {
		return err
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := Reply{Server: name, Local: c.LocalAddr().String(), Peer: c.RemoteAddr().String()}
				print(r)
				b, _ := json.Marshal(r)
				if _, err := c.Write(append(b, '\n')); err != nil {
					return
				}
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		print(Probe{Path: r.URL.Path, Peer: r.RemoteAddr})
		fmt.Fprintln(w, "ok")
	})
	hs := &http.Server{Addr: httpAddr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { <-ctx.Done(); _ = hs.Close(); _ = l.Close() }()
	if err := hs.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func dial(addr string) Result {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return Result{Err: err.Error()}
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return Result{Local: c.LocalAddr().String(), Err: fmt.Sprintf("read reply: %v", err)}
	}
	var r Reply
	if err := json.Unmarshal(line, &r); err != nil {
		return Result{Err: fmt.Sprintf("decode reply %q: %v", line, err)}
	}
	return Result{Reply: &r, Local: c.LocalAddr().String()}
}

func dns(name, server string) Result {
	res := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", server)
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ips, err := res.LookupIP(ctx, "ip4", name)
	if err != nil {
		return Result{Err: err.Error()}
	}
	var out Result
	for _, ip := range ips {
		out.Addrs = append(out.Addrs, ip.String())
	}
	return out
}

// hold keeps one connection to an echo server and checks every line comes
// back until ctx ends; the result says how many round trips passed and the
// first failure.
func hold(ctx context.Context, addr string) Result {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return Result{Err: err.Error()}
	}
	defer c.Close()
	rd := bufio.NewReader(c)
	line, err := rd.ReadBytes('\n')
	if err != nil {
		return Result{Err: fmt.Sprintf("read reply: %v", err)}
	}
	var r Reply
	if err := json.Unmarshal(line, &r); err != nil {
		return Result{Err: fmt.Sprintf("decode reply %q: %v", line, err)}
	}
	res := Result{Reply: &r, Local: c.LocalAddr().String()}
	print(res) // connected: the test waits for this line
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return res
		case <-tick.C:
		}
		msg := fmt.Sprintf("ping %d\n", res.Sent)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(c, msg); err != nil {
			res.Err = fmt.Sprintf("write %d: %v", res.Sent, err)
			return res
		}
		got, err := rd.ReadString('\n')
		if err != nil || got != msg {
			res.Err = fmt.Sprintf("echo %d: got %q: %v", res.Sent, got, err)
			return res
		}
		res.Sent++
	}
}
