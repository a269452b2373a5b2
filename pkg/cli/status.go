// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"fmt"
	"net/http"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
)

// agentOptions say where the agent answers.
type agentOptions struct {
	healthURL string
}

func (a *agentOptions) addFlags(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&a.healthURL, "health-url", "http://127.0.0.1:8000", "the agent's health endpoint")
}

// Status is what `ambient-ebpf status` reports.
type Status struct {
	Agent        AgentHealth `json:"agent"`
	Installed    bool        `json:"installed"`
	EnrolledPods int         `json:"enrolledPods"`
	PinError     string      `json:"pinError,omitempty"`
}

// AgentHealth is the agent's /healthz and /readyz.
type AgentHealth struct {
	Alive bool   `json:"alive"`
	Ready bool   `json:"ready"`
	Error string `json:"error,omitempty"`
}

func probe(ctx context.Context, url string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false, err
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK, nil
}

func statusCommand(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "status",
		Short: "Agent health, enrolled pod count and the data path in use",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(cmd.Context(), 3*time.Second)
			defer cancel()
			var st Status
			alive, err := probe(ctx, o.agent.healthURL+"/healthz")
			st.Agent.Alive = alive
			if err != nil {
				st.Agent.Error = err.Error()
			} else {
				st.Agent.Ready, _ = probe(ctx, o.agent.healthURL+"/readyz")
			}
			if p, err := o.open(); err != nil {
				st.PinError = err.Error()
			} else {
				st.Installed = true
				if pods, err := p.Pods(); err == nil {
					st.EnrolledPods = len(pods)
				}
				p.Close()
			}
			return o.emit(cmd.OutOrStdout(), st, func(w *tabwriter.Writer) {
				fmt.Fprintf(w, "agent alive\t%v\n", st.Agent.Alive)
				fmt.Fprintf(w, "agent ready\t%v\n", st.Agent.Ready)
				if st.Agent.Error != "" {
					fmt.Fprintf(w, "agent error\t%s\n", st.Agent.Error)
				}
				fmt.Fprintf(w, "data path pinned\t%v\n", st.Installed)
				if st.PinError != "" {
					fmt.Fprintf(w, "pin error\t%s\n", st.PinError)
				}
				fmt.Fprintf(w, "enrolled pods\t%d\n", st.EnrolledPods)
			})
		},
	}
}
