// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

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

// Status is what `ambient-ebpf status` reports. Its JSON has every field,
// zero or not: the agent's answer in protojson's camelCase names (null when
// it does not answer), then the pins' view.
type Status struct {
	// Agent is the running agent's view; nil when it does not answer.
	Agent      *inspectv1.StatusResponse
	AgentError string
	// Pinned is what the pins say, agent or not.
	Installed  bool
	PinnedPods int
	// Inconsistent are the pinned pods whose map entries do not all
	// give them capture (inspect.EnrolledPod.Problem): recorded as
	// enrolled, they are not fully redirected.
	Inconsistent []InconsistentPod
	PinError     string
}

// InconsistentPod is a pinned pod with a problem.
type InconsistentPod struct {
	Pod     string `json:"pod"` // namespace/name
	UID     string `json:"uid"`
	Problem string `json:"problem"`
}

// statusJSON is Status on the wire, the agent's answer already encoded.
type statusJSON struct {
	Agent      json.RawMessage `json:"agent"`
	AgentError string          `json:"agentError"`
	Installed  bool            `json:"installed"`
	PinnedPods int             `json:"pinnedPods"`
	// Inconsistent is [] when there are none: every field, always.
	Inconsistent []InconsistentPod `json:"inconsistentPods"`
	PinError     string            `json:"pinError"`
}

// MarshalJSON encodes the agent's protobuf answer with protojson, with its
// zero fields.
func (s Status) MarshalJSON() ([]byte, error) {
	w := statusJSON{Agent: json.RawMessage("null"), AgentError: s.AgentError, Installed: s.Installed, PinnedPods: s.PinnedPods,
		Inconsistent: append([]InconsistentPod{}, s.Inconsistent...), PinError: s.PinError}
	if s.Agent != nil {
		b, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(s.Agent)
		if err != nil {
			return nil, fmt.Errorf("encode agent status: %w", err)
		}
		w.Agent = b
	}
	return json.Marshal(w)
}

// UnmarshalJSON reads what MarshalJSON writes.
func (s *Status) UnmarshalJSON(b []byte) error {
	var w statusJSON
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*s = Status{AgentError: w.AgentError, Installed: w.Installed, PinnedPods: w.PinnedPods, Inconsistent: w.Inconsistent, PinError: w.PinError}
	if len(w.Agent) > 0 && string(w.Agent) != "null" {
		s.Agent = &inspectv1.StatusResponse{}
		if err := protojson.Unmarshal(w.Agent, s.Agent); err != nil {
			return fmt.Errorf("decode agent status: %w", err)
		}
	}
	return nil
}

// ErrUnhealthy is what `status` returns, after its report, when the agent
// does not answer or is not ready: the command then exits non-zero.
var ErrUnhealthy = errors.New("not healthy")

// problem says what is wrong, nil when the agent answers ready and every
// pinned pod is fully redirected.
func (s *Status) problem() error {
	switch {
	case len(s.Inconsistent) > 0:
		return fmt.Errorf("%w: %d pods recorded as enrolled are not fully redirected (see inconsistent pod)", ErrUnhealthy, len(s.Inconsistent))
	case s.Agent != nil && s.Agent.GetReady():
		return nil
	case s.Agent != nil:
		return fmt.Errorf("%w: the agent is not ready: %s", ErrUnhealthy, s.Agent.GetNotReadyReason())
	case s.Installed:
		return fmt.Errorf("%w: the agent does not answer; the pinned data path still redirects %d pods", ErrUnhealthy, s.PinnedPods)
	}
	return fmt.Errorf("%w: the agent does not answer and nothing is pinned (is ambient-ebpf running on this node? see --bpffs and --inspect-socket)", ErrUnhealthy)
}

// inspectClient makes a client of the agent's inspection socket. The path
// is made absolute first: in gRPC's "unix://" target a relative path's
// first element would be read as the authority.
func inspectClient(socket string) (*grpc.ClientConn, error) {
	abs, err := filepath.Abs(socket)
	if err != nil {
		return nil, fmt.Errorf("inspect socket %s: %w", socket, err)
	}
	conn, err := grpc.NewClient("unix://"+abs, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("inspect socket %s: %w", socket, err)
	}
	return conn, nil
}

func askAgent(ctx context.Context, socket string) (*inspectv1.StatusResponse, error) {
	conn, err := inspectClient(socket)
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
		Long: `Agent readiness, ztunnel connections, enrolled pods and kernel features in use.

Exits 0 when the agent answers and is ready, 1 otherwise (after the report):
the agent does not answer, or it is not ready yet.`,
		Args: cobra.NoArgs,
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
					for _, pod := range pods {
						if pod.Problem != "" {
							st.Inconsistent = append(st.Inconsistent, InconsistentPod{Pod: pod.Namespace + "/" + pod.Name, UID: pod.UID, Problem: pod.Problem})
						}
					}
				}
				p.Close()
			}
			err := o.emit(cmd.OutOrStdout(), st, func(w *tabwriter.Writer) {
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
					handback := a.IstioCniHandback
					if handback == "" {
						handback = "off"
					}
					fmt.Fprintf(w, "istio-cni takeover\t%v (hand-back on uninstall: %s)\n", a.IstioCniTakeover, handback)
					for _, p := range a.IstioCni {
						line := p.Phase
						if p.Phase == "draining istio-cni's connections" {
							line += fmt.Sprintf(" (%d left)", p.Flows)
						}
						if p.Reason != "" {
							line += ": " + p.Reason
						}
						fmt.Fprintf(w, "istio-cni pod %s/%s\t%s\n", p.Namespace, p.Name, line)
					}
				} else {
					fmt.Fprintf(w, "agent\t%s\n", st.AgentError)
				}
				fmt.Fprintf(w, "data path pinned\t%v\n", st.Installed)
				if st.PinError != "" {
					fmt.Fprintf(w, "pin error\t%s\n", st.PinError)
				}
				fmt.Fprintf(w, "pinned pods\t%d\n", st.PinnedPods)
				for _, p := range st.Inconsistent {
					fmt.Fprintf(w, "inconsistent pod %s\t%s\n", p.Pod, p.Problem)
				}
			})
			if err != nil {
				return err
			}
			return st.problem()
		},
	}
}
