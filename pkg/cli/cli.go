// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package cli is the `ambient-ebpf` command for people at a node: it reads
// the pinned data path directly (so it works while the agent is down) and
// asks the agent for what only the agent knows.
package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"reflect"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// options are the flags every command shares.
type options struct {
	bpffs  string
	output string
	agent  agentOptions
}

// NewCommand returns the root command writing to out.
func NewCommand(out io.Writer) *cobra.Command {
	o := &options{}
	root := &cobra.Command{
		Use:           "ambient-ebpf",
		Short:         "Inspect ambient-ebpf on this node",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			if o.output != "table" && o.output != "json" {
				return fmt.Errorf("--output %q: want table or json", o.output)
			}
			return nil
		},
	}
	root.SetOut(out)
	root.PersistentFlags().StringVar(&o.bpffs, "bpffs", bpfobj.DefaultBPFFSDir, "directory the data path is pinned under")
	root.PersistentFlags().StringVarP(&o.output, "output", "o", "table", "output format: table or json")
	o.agent.addFlags(root)
	root.AddCommand(podsCommand(o), mapsCommand(o), statsCommand(o), statusCommand(o), doctorCommand(o), whyCommand(o), traceCommand(o), versionCommand(o))
	setVersion(root)
	return root
}

// pinnedCommand is a command that reads the pins: it opens them, hands
// them to run and closes them.
func pinnedCommand(o *options, use, short string, run func(cmd *cobra.Command, p *inspect.Pinned) error) *cobra.Command {
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			p, err := o.open()
			if err != nil {
				return err
			}
			defer p.Close()
			return run(cmd, p)
		},
	}
}

func (o *options) open() (*inspect.Pinned, error) {
	p, err := inspect.OpenPinned(o.bpffs)
	if errors.Is(err, inspect.ErrNotInstalled) {
		return nil, fmt.Errorf("%w (is the agent installed on this node? see --bpffs)", err)
	}
	return p, err
}

// emit writes v as JSON or as the table. JSON output follows one
// convention for every command: camelCase field names (a key that is
// data, as a map or feature name, stays as it is), protobuf messages in
// protojson with their zero fields, and [] for an empty list, never null
// (TestEveryCommandsJSON holds each command to it).
func (o *options) emit(out io.Writer, v any, table func(w *tabwriter.Writer)) error {
	if o.output == "json" {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if v == nil {
			return enc.Encode(v)
		}
		return enc.Encode(emptyLists(reflect.ValueOf(v)).Interface())
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	table(w)
	return w.Flush()
}

func joinAddrs(ips []netip.Addr) string {
	s := make([]string, len(ips))
	for i, ip := range ips {
		s[i] = ip.String()
	}
	return strings.Join(s, ",")
}

func optionString(o podopts.Options) string {
	var s []string
	if o.BypassInbound {
		s = append(s, "ingress-mode")
	}
	if o.DNSCapture {
		s = append(s, "dns")
	}
	for _, v := range o.RerouteInterfaces {
		s = append(s, "reroute="+v)
	}
	if len(s) == 0 {
		return "-"
	}
	return strings.Join(s, ",")
}

func podsCommand(o *options) *cobra.Command {
	return pinnedCommand(o, "pods", "List the enrolled pods (from the pinned maps)",
		func(cmd *cobra.Command, p *inspect.Pinned) error {
			pods, err := p.Pods()
			if err != nil {
				return err
			}
			return o.emit(cmd.OutOrStdout(), pods, func(w *tabwriter.Writer) {
				fmt.Fprintln(w, "NAMESPACE/NAME\tUID\tIPS\tINTERFACES\tOPTIONS\tSTATE")
				for _, pod := range pods {
					state := "enrolled"
					if pod.Problem != "" {
						state = "inconsistent: " + pod.Problem
					}
					fmt.Fprintf(w, "%s/%s\t%s\t%s\t%s<->%s\t%s\t%s\n", pod.Namespace, pod.Name, pod.UID, joinAddrs(pod.IPs),
						pod.Interface, pod.HostInterface, optionString(pod.Options), state)
				}
			})
		})
}

func statsCommand(o *options) *cobra.Command {
	return pinnedCommand(o, "stats", "Per-pod redirect counters kept in BPF maps",
		func(cmd *cobra.Command, p *inspect.Pinned) error {
			dump, err := p.Dump()
			if err != nil {
				return err
			}
			return o.emit(cmd.OutOrStdout(), dump.Stats, func(w *tabwriter.Writer) {
				fmt.Fprintln(w, "POD\tOUTBOUND\tINBOUND\tDNS\tREROUTE\tPROBE-SNAT\tNO-LISTENER\tORIG-DST-ERR\tPROBE-TABLE-FULL")
				for _, s := range dump.Stats {
					st := s.Stats
					fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", s.Pod, st.OutboundRedirects, st.InboundRedirects,
						st.DNSRedirects, st.RerouteRedirects, st.ProbeSNAT, st.InboundNoListener, st.OrigDstErrors, st.ProbeNATFull)
				}
			})
		})
}

func mapsCommand(o *options) *cobra.Command {
	return pinnedCommand(o, "maps", "Every pinned map, decoded (works without the agent)",
		func(cmd *cobra.Command, p *inspect.Pinned) error {
			d, err := p.Dump()
			if err != nil {
				return err
			}
			return o.emit(cmd.OutOrStdout(), d, func(w *tabwriter.Writer) { printMaps(w, d) })
		})
}

func printMaps(w *tabwriter.Writer, d *inspect.MapDump) {
	fmt.Fprintf(w, "ae_pods (%d): enrolled pods by IP\n", len(d.Pods))
	fmt.Fprintln(w, "  IP\tPOD\tNETNS-COOKIE\tSLOT\tOPTIONS")
	for _, e := range d.Pods {
		fmt.Fprintf(w, "  %s\t%s\t%d\t%d\t%s\n", e.IP, e.Pod, e.NetnsCookie, e.Slot, optionString(e.Options))
	}
	fmt.Fprintf(w, "\nae_netns (%d): enrolled pods by netns cookie\n", len(d.Netns))
	fmt.Fprintln(w, "  NETNS-COOKIE\tPOD\tIPV4\tIPV6\tSLOT\tOPTIONS")
	for _, e := range d.Netns {
		fmt.Fprintf(w, "  %d\t%s\t%s\t%s\t%d\t%s\n", e.NetnsCookie, e.Pod, addrOrDash(e.IPv4), addrOrDash(e.IPv6), e.Slot, optionString(e.Options))
	}
	fmt.Fprintf(w, "\nae_pod_meta (%d slots in use)\n", len(d.Meta))
	fmt.Fprintln(w, "  SLOT\tPOD\tUID\tINTERFACE\tHOST-INTERFACE")
	for _, e := range d.Meta {
		fmt.Fprintf(w, "  %d\t%s\t%s\t%s\t%s\n", e.Slot, e.Pod, e.UID, e.Interface, e.HostInterface)
	}
	fmt.Fprintf(w, "\nae_orig_dst (%d): original destinations filed for ztunnel\n", len(d.OrigDst))
	fmt.Fprintln(w, "  NETNS-COOKIE\tCLIENT\tORIGINAL-DESTINATION")
	for _, e := range d.OrigDst {
		fmt.Fprintf(w, "  %d\t%s\t%s\n", e.NetnsCookie, e.Client, e.OrigDst)
	}
	fmt.Fprintf(w, "\nae_probe_nat (%d): live host probes (snat: their translations; direct: the node sockets' flows)\n", len(d.ProbeNAT))
	fmt.Fprintln(w, "  POD\tPROBER\tPROBER-PORT")
	for _, e := range d.ProbeNAT {
		fmt.Fprintf(w, "  %s\t%s\t%d\n", e.Pod, e.Host, e.HostPort)
	}
	fmt.Fprintf(w, "\nae_stats: see `ambient-ebpf stats`; ae_sk_dst is socket storage and cannot be listed\n")
}

func addrOrDash(a netip.Addr) string {
	if !a.IsValid() {
		return "-"
	}
	return a.String()
}
