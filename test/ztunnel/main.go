// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command ztunnel is a stand-in for ztunnel in tests and the demo: it takes
// pods from the node agent over ZDS, opens ztunnel's in-pod sockets in each
// pod's netns, relays TCP, answers DNS, and writes one JSON line per
// connection it handled.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/zdsclient"
)

type dnsEntries map[string]netip.Addr

func (d dnsEntries) String() string { return fmt.Sprint(map[string]netip.Addr(d)) }

func (d dnsEntries) Set(v string) error {
	name, addr, ok := strings.Cut(v, "=")
	if !ok {
		return fmt.Errorf("want name=address, got %q", v)
	}
	a, err := netip.ParseAddr(addr)
	if err != nil {
		return err
	}
	d[name] = a
	return nil
}

func main() {
	socket := flag.String("zds-socket", zdsclient.DefaultSocketPath, "the node agent's ZDS socket")
	records := flag.String("records", "", "append a JSON line per connection to this file")
	upstream := flag.String("dns-upstream", "", "DNS server for names the table does not know (address:port)")
	plain := flag.Bool("plain-inbound", false, "deliver inbound traffic from the pod's address instead of the client's")
	table := dnsEntries{}
	flag.Var(table, "dns", "answer name=address from the DNS proxy (repeatable; *.suffix matches subdomains)")
	flag.Parse()

	if err := run(*socket, *records, *upstream, *plain, table); err != nil && !errors.Is(err, context.Canceled) {
		slog.Error("ztunnel stand-in failed", "error", err)
		os.Exit(1)
	}
}

func run(socket, records, upstream string, plain bool, table dnsEntries) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	cfg := standin.Config{PlainInbound: plain, DNS: standin.DNS{Table: table}}
	if upstream != "" {
		up, err := netip.ParseAddrPort(upstream)
		if err != nil {
			return fmt.Errorf("parse --dns-upstream: %w", err)
		}
		cfg.DNS.Upstream = up
	}
	if records != "" {
		f, err := os.OpenFile(records, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		if err != nil {
			return fmt.Errorf("open records file: %w", err)
		}
		defer f.Close()
		cfg.Records = f
	}
	p := standin.New(cfg)
	defer p.Close()
	return p.ServeZDS(ctx, socket)
}
