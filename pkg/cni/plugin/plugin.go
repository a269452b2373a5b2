// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package plugin is the ambient-ebpf CNI plugin, chained after the primary
// CNI. It forwards ADD and DEL to the node agent (pkg/cni/events) and fails
// closed: an ambient pod never starts unredirected. When the agent cannot be
// reached it decides by itself from a fallback read of the pod (API or
// standalone pod file) whether the pod may start without it.
package plugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime/debug"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
)

// About is printed when the binary runs without CNI_COMMAND.
const About = "ambient-ebpf-cni: chained CNI plugin that enrolls ambient pods with the ambient-ebpf node agent"

// Agent is the plugin's view of the node agent; *events.Client implements it.
type Agent interface {
	PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error)
	PodDel(ctx context.Context, req *cniv1.PodDelRequest) error
	Close() error
}

// Plugin runs the CNI commands. Its function fields are the seams tests
// replace; New fills them with the real agent client and fallback sources.
type Plugin struct {
	Stdout io.Writer
	Log    *slog.Logger
	// DialAgent returns a client for the agent at conf.AgentSocket.
	DialAgent func(conf *Config) (Agent, error)
	// Fallback decides whether the pod is ambient when the agent cannot
	// be asked (by default: the ambient-ebpf-cni-fallback binary).
	Fallback func(conf *Config, pod *cniv1.Pod) (Decision, error)
	// FallbackBinary is the fallback binary Fallback runs by default;
	// empty: ambient-ebpf-cni-fallback next to this binary.
	FallbackBinary string
	// ProbeAgent reports whether the agent answers on its socket in time.
	ProbeAgent func(ctx context.Context, conf *Config) error
}

// New returns a plugin that writes results to stdout and logs to log.
func New(stdout io.Writer, log *slog.Logger) *Plugin {
	p := &Plugin{
		Stdout:     stdout,
		Log:        log,
		DialAgent:  func(conf *Config) (Agent, error) { return events.NewClient(conf.AgentSocket) },
		ProbeAgent: probeSocket,
	}
	p.Fallback = p.execFallback
	return p
}

// Funcs returns the commands for skel.PluginMainFuncs; each turns a panic
// into a CNI error so the runtime always gets an answer.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{
		Add:    recovered(p.Add),
		Del:    recovered(p.Del),
		Check:  recovered(p.Check),
		Status: recovered(p.Status),
		GC:     recovered(p.GC),
	}
}

func recovered(f func(*skel.CmdArgs) error) func(*skel.CmdArgs) error {
	return func(args *skel.CmdArgs) (err error) {
		defer func() {
			if r := recover(); r != nil {
				err = types.NewError(types.ErrInternal, fmt.Sprintf("ambient-ebpf-cni panicked: %v", r), string(debug.Stack()))
			}
		}()
		return f(args)
	}
}

// Add forwards the pod to the agent and, on success, prints the previous
// result unchanged.
func (p *Plugin) Add(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing prevResult",
			"ambient-ebpf-cni must be chained after the primary CNI plugin in a conflist")
	}
	pod, isPod, err := podFromArgs(args, true)
	if err != nil {
		return err
	}
	if !isPod {
		p.Log.Info("no K8S_POD_NAME/K8S_POD_NAMESPACE in CNI_ARGS, passing through", "container", args.ContainerID)
		return p.pass(conf)
	}
	log := p.Log.With("pod", pod.GetNamespace()+"/"+pod.GetName(), "container", args.ContainerID)
	if reason, ok := conf.passesWithoutAgent(pod); ok {
		log.Info("passing through without the agent", "reason", reason)
		return p.pass(conf)
	}
	ips, err := prevIPs(conf.PrevResult)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, "read prevResult addresses", err.Error())
	}
	agentErr := p.callAdd(conf, &cniv1.PodAddRequest{Pod: pod, Ips: ips})
	switch {
	case agentErr == nil:
		return p.pass(conf)
	case errors.Is(agentErr, events.ErrNotEnrolled):
		return failClosed(pod, agentErr)
	}
	// The agent was not there to decide: decide from the fallback read
	// whether this pod may start without it. A pod whose membership cannot
	// be decided (the pod or its namespace unreadable: a namespace label
	// alone makes a pod ambient) fails closed, in whatever namespace; only
	// excluded namespaces and the agent's own pods pass without a read.
	d, err := p.decideWithoutAgent(conf, pod)
	if err != nil {
		return failClosed(pod, fmt.Errorf("%w; fallback: %w", agentErr, err))
	}
	if d.Ambient {
		return failClosed(pod, fmt.Errorf("%w; the pod is ambient (%s)", agentErr, d.Reason))
	}
	log.Warn("agent down, pod is not ambient, passing through", "reason", d.Reason, "agent", agentErr)
	return p.pass(conf)
}

func (p *Plugin) callAdd(conf *Config, req *cniv1.PodAddRequest) error {
	agent, err := p.DialAgent(conf)
	if err != nil {
		return fmt.Errorf("%w: %w", events.ErrAgentUnreachable, err)
	}
	defer agent.Close()
	ctx, cancel := context.WithTimeout(context.Background(), conf.agentTimeout)
	defer cancel()
	resp, err := agent.PodAdd(ctx, req)
	if err != nil {
		return err
	}
	p.Log.Info("agent answered", "pod", req.GetPod().GetNamespace()+"/"+req.GetPod().GetName(),
		"enrolled", resp.GetEnrolled(), "reason", resp.GetReason())
	return nil
}

func (p *Plugin) decideWithoutAgent(conf *Config, pod *cniv1.Pod) (Decision, error) {
	return p.Fallback(conf, pod)
}

// failClosed is the ADD error for a pod that must not start yet. Code 11
// (try again later) makes the runtime retry the sandbox.
func failClosed(pod *cniv1.Pod, err error) error {
	return types.NewError(types.ErrTryAgainLater,
		fmt.Sprintf("pod %s/%s not started: %v", pod.GetNamespace(), pod.GetName(), err),
		"ambient-ebpf fails closed: an ambient pod never starts without redirection")
}

func (p *Plugin) pass(conf *Config) error {
	res, err := conf.PrevResult.GetAsVersion(conf.CNIVersion)
	if err != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "convert prevResult", err.Error())
	}
	if err := res.PrintTo(p.Stdout); err != nil {
		return types.NewError(types.ErrIOFailure, "print result", err.Error())
	}
	return nil
}

// Del tells the agent; it never fails because the agent is down (the agent
// reconciles removed pods by itself). A DEL naming an invalid identity is
// logged and not forwarded, but succeeds: the ADD refused that identity, so
// nothing of ours exists for it, and failing would stop the runtime from
// running the primary CNI's DEL.
func (p *Plugin) Del(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	pod, isPod, err := podFromArgs(args, false)
	if err != nil {
		p.Log.Warn("cni del not forwarded", "container", args.ContainerID, "error", err)
		return nil
	}
	if !isPod {
		return nil
	}
	if _, ok := conf.passesWithoutAgent(pod); ok {
		return nil
	}
	agent, err := p.DialAgent(conf)
	if err != nil {
		p.Log.Warn("cni del not forwarded", "pod", pod.GetNamespace()+"/"+pod.GetName(), "error", err)
		return nil
	}
	defer agent.Close()
	ctx, cancel := context.WithTimeout(context.Background(), conf.agentTimeout)
	defer cancel()
	if err := agent.PodDel(ctx, &cniv1.PodDelRequest{Pod: pod}); err != nil {
		p.Log.Warn("cni del not forwarded", "pod", pod.GetNamespace()+"/"+pod.GetName(), "error", err)
	}
	return nil
}

// Check validates the configuration and the previous result; the agent's
// state is reconciled by the agent itself.
func (p *Plugin) Check(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	if conf.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing prevResult", "CHECK needs the result of the ADD")
	}
	return nil
}

// Status answers whether the plugin can serve ADD: yes when the agent
// answers a health check within agentTimeout, or when a fallback source lets non-ambient pods
// through while it is down; otherwise error 50 (plugin not available).
func (p *Plugin) Status(args *skel.CmdArgs) error {
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), conf.agentTimeout)
	defer cancel()
	probeErr := p.ProbeAgent(ctx, conf)
	if probeErr == nil || conf.hasFallback() {
		return nil
	}
	return types.NewError(types.ErrPluginNotAvailable,
		fmt.Sprintf("agent unreachable at %s and no fallback configured", conf.AgentSocket), probeErr.Error())
}

// GC has nothing to collect: the plugin keeps no state, and the agent
// reconciles pods that are gone.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	_, err := ParseConfig(args.StdinData)
	return err
}

// probeSocket asks the agent whether it serves, within ctx's deadline: an
// agent that accepts the connection but never answers is unavailable.
func probeSocket(ctx context.Context, conf *Config) error {
	if err := events.Probe(ctx, conf.AgentSocket); err != nil {
		return fmt.Errorf("probe agent socket %s: %w", conf.AgentSocket, err)
	}
	return nil
}
