// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
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
	// PerPodMetrics adds each pod's BPF counters, under its namespace and
	// name, to the node totals /metrics always has.
	PerPodMetrics bool
	// TraceHistory, when positive, keeps tracing on and the decisions of
	// this window in memory, for `ambient-ebpf trace --since`.
	TraceHistory time.Duration

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

	// IstioCNITakeover takes running pods over from istio-cni in place:
	// a pod holding exactly istio-cni's rules is enrolled, then its rules
	// go (pkg/takeover); one holding other rules stays on them.
	IstioCNITakeover bool
	// IstioCNIHandBack, when set, is the backend an uninstall writes
	// istio-cni's exact rules in, for every pod the data path redirects,
	// before the data path goes: the node goes back to istio-cni with no
	// pod unredirected at any moment. Empty: an uninstall only removes.
	IstioCNIHandBack istiocni.Backend

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

// validate checks every socket path, the pod file and the listen addresses
// before the agent creates anything, each error naming its flag: a socket
// path must be absolute, distinct from the others and free (nothing there,
// or a stale socket; internal/unixsock), the pod file a readable regular
// file, each address host:port with an IP (or localhost) and a port.
func (c *Config) validate() error {
	var errs []error
	seen := map[string]string{} // socket path -> flag
	for _, s := range []struct{ flag, network, path string }{
		{"--zds-socket", "unixpacket", c.ZDSSocket},
		{"--cni-socket", "unix", c.CNISocket},
		{"--inspect-socket", "unix", c.InspectSocket},
	} {
		if err := unixsock.Check(s.network, s.path); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", s.flag, err))
			continue
		}
		key := samePathKey(s.path)
		if other, ok := seen[key]; ok {
			errs = append(errs, fmt.Errorf("%s %s: the same socket as %s", s.flag, s.path, other))
			continue
		}
		seen[key] = s.flag
	}
	if c.StandalonePods != "" {
		if err := checkPodFile(c.StandalonePods); err != nil {
			errs = append(errs, fmt.Errorf("--standalone-pods %s: %w", c.StandalonePods, err))
		}
	}
	for _, a := range []struct{ flag, addr string }{{"--health-addr", c.HealthAddr}, {"--metrics-addr", c.MetricsAddr}} {
		if err := checkListenAddr(a.addr); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: %w", a.flag, a.addr, err))
		}
	}
	if c.HealthAddr == c.MetricsAddr && !strings.HasSuffix(c.HealthAddr, ":0") {
		errs = append(errs, fmt.Errorf("--health-addr and --metrics-addr are both %q", c.HealthAddr))
	}
	return errors.Join(errs...)
}

// samePathKey names a socket path so that two spellings of one file
// compare equal: the directory with symlinks resolved (/var/run and /run),
// when it exists.
func samePathKey(path string) string {
	dir, base := filepath.Split(filepath.Clean(path))
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	return filepath.Join(dir, base)
}

// checkPodFile requires a regular file (after symlinks, as a mounted
// ConfigMap has them) that can be opened for reading.
func checkPodFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("not a regular file (mode %v)", fi.Mode())
	}
	return nil
}

// checkListenAddr requires host:port with an empty host (every address),
// an IP address or localhost, and a numeric port.
func checkListenAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("port %q is not a number from 0 to 65535", port)
	}
	if host == "" || host == "localhost" {
		return nil
	}
	if _, err := netip.ParseAddr(host); err != nil {
		return fmt.Errorf("host %q is not an IP address", host)
	}
	return nil
}
