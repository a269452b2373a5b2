// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"fmt"
	"log/slog"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// Config is everything the agent needs; cmd/ambient-ebpf-agent fills it
// from flags.
type Config struct {
	// NodeName is this node (spec.nodeName of its pods).
	NodeName string
	// Kubeconfig is a kubeconfig path; empty means in-cluster.
	Kubeconfig string
	// StandalonePods, when set, is the pod file used instead of the
	// Kubernetes API (pkg/standalone).
	StandalonePods string

	Dataplane  dataplane.Config
	Enrollment enrollment.Config
	// Repair is what to do with an ambient pod that runs unredirected.
	Repair kube.RepairConfig

	ZDSSocket     string
	CNISocket     string
	InspectSocket string
	// ProcRoot is scanned to find running pods' netns (host /proc).
	ProcRoot string

	HealthAddr  string
	MetricsAddr string

	// Install, when set, installs and watches the CNI plugin on the host.
	Install *install.Config

	// DaemonSetNamespace and DaemonSetName identify the agent's DaemonSet:
	// on shutdown, all state stays while it exists (restart, upgrade) and
	// goes when it does not (uninstall). Empty: state always stays, unless
	// UninstallOnExit.
	DaemonSetNamespace, DaemonSetName string
	// UninstallOnExit removes everything on shutdown (standalone nodes and
	// the demo, which have no DaemonSet).
	UninstallOnExit bool

	Logger *slog.Logger
}

// Defaults.
const (
	DefaultHealthAddr  = ":8000"
	DefaultMetricsAddr = ":15014"
	DefaultProcRoot    = "/proc"
)

func (c *Config) setDefaults() error {
	if c.NodeName == "" && c.StandalonePods == "" {
		return errors.New("no node name (set --node-name or NODE_NAME)")
	}
	if c.ZDSSocket == "" {
		c.ZDSSocket = zds.DefaultSocketPath
	}
	if c.CNISocket == "" {
		c.CNISocket = events.DefaultSocketPath
	}
	if c.InspectSocket == "" {
		c.InspectSocket = DefaultInspectSocket
	}
	if c.ProcRoot == "" {
		c.ProcRoot = DefaultProcRoot
	}
	if c.HealthAddr == "" {
		c.HealthAddr = DefaultHealthAddr
	}
	if c.MetricsAddr == "" {
		c.MetricsAddr = DefaultMetricsAddr
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Dataplane.Logger == nil {
		c.Dataplane.Logger = c.Logger.With("component", "dataplane")
	}
	if c.Install != nil && c.Install.Log == nil {
		c.Install.Log = c.Logger
	}
	if c.StandalonePods != "" && c.Repair.Mode != "" && c.Repair.Mode != kube.RepairInPlace && c.Repair.Mode != kube.RepairOff {
		return fmt.Errorf("repair mode %q needs the Kubernetes API; the pod file allows only in-place repair", c.Repair.Mode)
	}
	return nil
}
