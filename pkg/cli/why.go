// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

func whyCommand(o *options) *cobra.Command {
	var (
		mark uint32
		ipv6 bool
		via  string
	)
	cmd := &cobra.Command{
		Use:   "why FROM TO[:PORT] [tcp|udp]",
		Short: "What the data path would do with a connection, and why, step by step (from the pins)",
		Long: `why answers, from the pinned maps and the pods' options, what would happen to a
connection, without sending it: every hook it meets, each check on the way with
its contract row (R1..R16, H1..H4), and each decision.

FROM is an enrolled pod (NAMESPACE/NAME), an address (an outside host, or an
enrolled pod's), or "node" for a local socket of the node (kubelet's probes).
TO is an address (198.19.0.2, 198.19.0.2:8080, [fd00::2]:8080) or an enrolled
pod (NAMESPACE/NAME[:PORT], its IPv4 address unless --ipv6). Without a port the
answer holds for any port but 53 and 15008.`,
		Example: `  ambient-ebpf why shop/web 198.19.0.2:8080
  ambient-ebpf why shop/web 10.96.0.10:53 udp
  ambient-ebpf why 198.19.0.2 shop/web:8080
  ambient-ebpf why node shop/web:8080
  ambient-ebpf why --via tap0 shop/vm 198.19.0.2:443`,
		Args: cobra.RangeArgs(2, 3),
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := o.open()
			if err != nil {
				return err
			}
			defer p.Close()
			q, err := parseQuery(p, args, ipv6)
			if err != nil {
				return err
			}
			q.Mark, q.Via = mark, via
			a, err := p.Why(q)
			if errors.Is(err, inspect.ErrUnknownPod) {
				return fmt.Errorf("%w (ambient-ebpf pods lists them)", err)
			}
			if err != nil {
				return err
			}
			return o.emit(cmd.OutOrStdout(), a, func(w *tabwriter.Writer) { printAnswer(w, a) })
		},
	}
	cmd.Flags().Uint32Var(&mark, "mark", 0, "the client socket's mark (ztunnel's is 0x539)")
	cmd.Flags().BoolVarP(&ipv6, "ipv6", "6", false, "when TO is a pod, use its IPv6 address")
	cmd.Flags().StringVar(&via, "via", "", "the connection arrives on this virtual interface of the FROM pod (R14: a VM behind it)")
	return cmd
}

func parseQuery(p *inspect.Pinned, args []string, ipv6 bool) (inspect.Query, error) {
	var q inspect.Query
	switch from := args[0]; {
	case from == "node":
		q.FromNode = true
	case strings.Contains(from, "/"):
		q.FromPod = from
	default:
		a, err := netip.ParseAddr(from)
		if err != nil {
			return q, fmt.Errorf("FROM %q: not NAMESPACE/NAME, an address or \"node\"", from)
		}
		q.FromAddr = a
	}
	to, err := parseDest(p, args[1], ipv6)
	if err != nil {
		return q, err
	}
	q.To = to
	if len(args) == 3 {
		switch args[2] {
		case "tcp":
		case "udp":
			q.UDP = true
		default:
			return q, fmt.Errorf("protocol %q: want tcp or udp", args[2])
		}
	}
	return q, nil
}

// parseDest reads ADDRESS[:PORT] or NAMESPACE/NAME[:PORT].
func parseDest(p *inspect.Pinned, s string, ipv6 bool) (netip.AddrPort, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap, nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		return netip.AddrPortFrom(a, 0), nil
	}
	if !strings.Contains(s, "/") {
		return netip.AddrPort{}, fmt.Errorf("TO %q: not ADDRESS[:PORT], [IPV6]:PORT or NAMESPACE/NAME[:PORT]", s)
	}
	name, portStr, hasPort := strings.Cut(s, ":")
	var port uint64
	if hasPort {
		var err error
		if port, err = strconv.ParseUint(portStr, 10, 16); err != nil {
			return netip.AddrPort{}, fmt.Errorf("TO %q: bad port %q", s, portStr)
		}
	}
	pods, err := p.Pods()
	if err != nil {
		return netip.AddrPort{}, err
	}
	for _, pod := range pods {
		if pod.Namespace+"/"+pod.Name != name {
			continue
		}
		for _, ip := range pod.IPs {
			if ip.Is6() == ipv6 {
				return netip.AddrPortFrom(ip, uint16(port)), nil
			}
		}
		return netip.AddrPort{}, fmt.Errorf("pod %s has no IPv%s address", name, map[bool]string{false: "4", true: "6"}[ipv6])
	}
	return netip.AddrPort{}, fmt.Errorf("pod %s: %w (ambient-ebpf pods lists them)", name, inspect.ErrUnknownPod)
}

// endpoint prints an address with its port: "*" for no address, and for
// port 0 nothing (an unbound socket) or, with anyPort, "*" (any port).
func endpoint(ap netip.AddrPort, anyPort bool) string {
	switch {
	case !ap.IsValid():
		return "*"
	case ap.Port() != 0:
		return ap.String()
	}
	addr := ap.Addr().String()
	if ap.Addr().Is6() {
		addr = "[" + addr + "]"
	}
	if anyPort {
		return addr + ":*"
	}
	return addr
}

func printAnswer(w *tabwriter.Writer, a *inspect.Answer) {
	fmt.Fprintf(w, "%s -> %s %s: %s\n", a.From, endpoint(a.To, true), a.Proto, a.Summary)
	for i, l := range a.Legs {
		who := ""
		if l.Who != "" {
			who = " (" + l.Who + ")"
		}
		fmt.Fprintf(w, "%d. %s%s: %s -> %s\n", i+1, l.Where, who, endpoint(l.Src, false), endpoint(l.Dst, true))
		for _, s := range l.Steps {
			result := s.Result
			if s.Result != "continue" && l.To.IsValid() {
				result += " -> " + endpoint(l.To, false)
			}
			fmt.Fprintf(w, "   %s\t%s\t%s\n", s.Row, s.Check, result)
		}
	}
}
