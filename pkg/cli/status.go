// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/inspectv1"
)

// agentOptions say where the agent answers and how long to wait for it.
type agentOptions struct {
	inspectSocket string
	timeout       time.Duration
}

func (a *agentOptions) addFlags(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&a.inspectSocket, "inspect-socket", "/var/run/ambient-ebpf/inspect.sock", "the agent's inspection socket")
	cmd.PersistentFlags().DurationVar(&a.timeout, "agent-timeout", 3*time.Second, "how long to wait for the agent's answer; an agent that accepts but does not answer in time is reported unreachable")
}

// Status is what `ambient-ebpf status` reports.
type Status struct {
	// Agent is the running agent's view; nil when it does not answer.
	Agent      *inspectv1.StatusResponse `json:"agent,omitempty"`
	AgentError string                    `json:"agentError,omitempty"`
	// Pinned is what the pins say, agent or not.
	Installed  bool   `json:"installed"`
	PinnedPods int    `json:"pinnedPods"`
	PinError   string `json:"pinError,omitempty"`
}

func askAgent(ctx context.Context, socket string) (*inspectv1.StatusResponse, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return inspectv1.NewInspectClient(conn).Status(ctx, &inspectv1.StatusRequest{})
}

func statusCommand(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Agent readiness, ztunnel connections, enrolled pods and kernel features in use",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), o.agent.timeout)
			defer cancel()
			var st Status
			if resp, err := askAgent(ctx, o.agent.inspectSocket); status.Code(err) == codes.DeadlineExceeded {
				st.AgentError = fmt.Sprintf("agent not reachable on %s: no answer within %v", o.agent.inspectSocket, o.agent.timeout)
			} else if err != nil {
				st.AgentError = fmt.Sprintf("agent not reachable on %s: %v", o.agent.inspectSocket, err)
			} else {
				st.Agent = resp
			}
			if p, err := o.open(); err != nil {
				st.PinError = err.Error()
			} else {
				st.Installed = true
				if pods, err := p.Pods(); err == nil {
					st.PinnedPods = len(pods)
				}
				p.Close()
			}
			return o.emit(cmd.OutOrStdout(), st, func(w *tabwriter.Writer) {
				if a := st.Agent; a != nil {
					ready := "yes"
					if !a.Ready {
						ready = "no: " + a.NotReadyReason
					}
					fmt.Fprintf(w, "agent ready\t%s\n", ready)
					fmt.Fprintf(w, "node\t%s (pods from %s)\n", a.Node, a.Source)
					fmt.Fprintf(w, "ztunnel connections\t%d\n", a.ZtunnelConnections)
					fmt.Fprintf(w, "enrolled pods\t%d (%d pending ztunnel)\n", a.EnrolledPods, a.PendingPods)
					for _, f := range slices.Sorted(maps.Keys(a.Features)) {
						fmt.Fprintf(w, "kernel feature %s\t%v\n", f, a.Features[f])
					}
				} else {
					fmt.Fprintf(w, "agent\t%s\n", st.AgentError)
				}
				fmt.Fprintf(w, "data path pinned\t%v\n", st.Installed)
				if st.PinError != "" {
					fmt.Fprintf(w, "pin error\t%s\n", st.PinError)
				}
				fmt.Fprintf(w, "pinned pods\t%d\n", st.PinnedPods)
			})
		},
	}
}
