// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/doctor"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

func doctorCommand(o *options) *cobra.Command {
	var cfg doctor.Config
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Node preflight: kernel features, mounts, CNI chain, ztunnel's socket, conflicts on our hooks",
		Long: `doctor checks this node before and after installing ambient-ebpf. It only reads.
Each finding is ok, info, warn or fail and says what it means and what to do;
the command exits non-zero when any check fails.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.BPFFSDir = o.bpffs
			cfg.Agent = func(ctx context.Context) (*inspectv1.StatusResponse, error) {
				return askAgent(ctx, o.agent.inspectSocket)
			}
			r := doctor.Run(cmd.Context(), cfg)
			err := o.emit(cmd.OutOrStdout(), r, func(w *tabwriter.Writer) {
				fmt.Fprintln(w, "STATUS\tCHECK\tFINDING")
				for _, f := range r.Findings {
					fmt.Fprintf(w, "%s\t%s\t%s\n", f.Status, f.Check, f.Summary)
					if f.Meaning != "" {
						fmt.Fprintf(w, "\t\t  means: %s\n", f.Meaning)
					}
					if f.Action != "" {
						fmt.Fprintf(w, "\t\t  do: %s\n", f.Action)
					}
				}
				fmt.Fprintf(w, "\n%d ok, %d info, %d warnings, %d failures\n", r.Counts[doctor.OK], r.Counts[doctor.Info], r.Counts[doctor.Warn], r.Counts[doctor.Fail])
			})
			if err != nil {
				return err
			}
			if r.Failed() {
				return fmt.Errorf("doctor: %d of %d checks failed", r.Counts[doctor.Fail], len(r.Findings))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.CgroupRoot, "cgroup-root", "", "the agent's --cgroup-root; empty: the cgroup2 mount")
	f.StringVar(&cfg.NodeNetns, "node-netns", "", "netns of the pods' host-side veths and the node's iptables rules; empty: this one")
	f.StringVar(&cfg.CNIConfDir, "cni-conf-dir", "/etc/cni/net.d", "the host's CNI configuration directory")
	f.StringVar(&cfg.ZDSSocket, "zds-socket", zds.DefaultSocketPath, "ztunnel's ZDS socket")
	return cmd
}
