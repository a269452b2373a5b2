// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
)

// Flags are the agent's command line; Config turns them into a Config.
type Flags struct {
	fs *flag.FlagSet

	nodeName, kubeconfig, standalone            string
	bpffs, cgroupRoot, nodeNetns                string
	podsCgroup                                  string
	socketHooks                                 string
	probeV4, probeV6                            string
	hostProbes                                  string
	zdsSocket, cniSocket, procRoot              string
	inspectSocket                               string
	healthAddr, metricsAddr                     string
	cniBinDirs                                  listFlag
	cniConfDir, cniConfName, pluginBinary       string
	cniOwnedConflist                            string
	cniKubeconfig, tokenPath, caPath, apiServer string
	hostRoot                                    string
	installCNI                                  bool
	excluded, selectors                         string
	dnsCapture                                  bool
	sockmapAccel                                string
	repairMode                                  string
	dsNamespace, dsName                         string
	systemNamespace                             string
	uninstallOnExit                             bool
	istioCNITakeover                            bool
	istioCNIHandBack                            string
	logLevel, logFormat                         string
	version                                     bool
	perPodMetrics                               bool
	traceHistory                                time.Duration
}

type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error {
	*l = append(*l, v)
	return nil
}

// DefaultOwnedConflist is the owned conflist's name: "00-" sorts it before
// the primaries' (Cilium 05-, Calico 10-, flannel 10-, Multus 00-multus).
const DefaultOwnedConflist = "00-ambient-ebpf.conflist"

// NewFlags registers the agent's flags on fs.
func NewFlags(fs *flag.FlagSet) *Flags {
	f := &Flags{fs: fs}
	fs.StringVar(&f.nodeName, "node-name", os.Getenv("NODE_NAME"), "this node's name (default $NODE_NAME)")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig path; empty: in-cluster")
	fs.StringVar(&f.standalone, "standalone-pods", "", "read pods and namespaces from this file instead of the Kubernetes API")
	fs.StringVar(&f.bpffs, "bpffs-dir", bpfobj.DefaultBPFFSDir, "directory all pins live under (on a bpffs)")
	fs.StringVar(&f.cgroupRoot, "cgroup-root", "", "cgroup v2 directory the socket hooks attach to; empty: the cgroup2 mount")
	fs.StringVar(&f.podsCgroup, "pods-cgroup", "auto", "the cgroup v2 directory below --cgroup-root that holds every pod, ztunnel's included: the socket programs attach there, so pods' sockets meet them before any program at the root (a socket load balancer), and, where the kernel refuses fentry on tcp_connect (host probes), a node-wide half for the node's own sockets attaches to the root; auto: kubepods.slice or kubepods right below the root when there, else none; none: every program at the root")
	fs.StringVar(&f.socketHooks, "socket-hooks", string(dataplane.SocketHooksShared), "where enrolled pods' socket programs attach: shared (once, on --pods-cgroup: every pod's socket meets them, in the mesh or not) or pods (on each enrolled pod's cgroup and on ztunnel's, found from its ZDS connection: sockets of what is not in the mesh meet no program of ours, or only the node-wide half at the root where the kernel refuses fentry); pods needs --pods-cgroup and starts on a node without pods enrolled under shared hooks")
	fs.StringVar(&f.nodeNetns, "node-netns", "", "the node's netns (where pods' veth peers are); empty: the agent's own")
	fs.StringVar(&f.hostProbes, "host-probes", string(bpfobj.ProbeDirect), "how the node's own connections to enrolled pods (kubelet's probes) reach the app: direct (with the node's address) or snat (from the --probe-snat addresses, as istio-cni)")
	fs.StringVar(&f.probeV4, "probe-snat-v4", bpfobj.DefaultProbeV4.String(), "host-probe SNAT address (IPv4)")
	fs.StringVar(&f.probeV6, "probe-snat-v6", bpfobj.DefaultProbeV6.String(), "host-probe SNAT address (IPv6)")
	fs.StringVar(&f.zdsSocket, "zds-socket", "", "ZDS socket ztunnel connects to (default /var/run/ztunnel/ztunnel.sock)")
	fs.StringVar(&f.cniSocket, "cni-socket", "", "socket the CNI plugin calls (default /var/run/ambient-ebpf/cni.sock)")
	fs.StringVar(&f.inspectSocket, "inspect-socket", "", "socket the CLI asks (default "+DefaultInspectSocket+")")
	fs.StringVar(&f.procRoot, "proc-root", DefaultProcRoot, "the host's /proc, scanned for running pods' netns")
	fs.StringVar(&f.healthAddr, "health-addr", DefaultHealthAddr, "address of /healthz and /readyz")
	fs.StringVar(&f.metricsAddr, "metrics-addr", DefaultMetricsAddr, "address of /metrics (127.0.0.1:15014 keeps them on the node)")
	fs.BoolVar(&f.perPodMetrics, "per-pod-metrics", false, "add each pod's BPF counters, labelled with its namespace and name, to the node totals (several series per pod: mind the cardinality, and who reads /metrics)")
	fs.DurationVar(&f.traceHistory, "trace-history", 0, "keep tracing on and the decisions of this window in memory for `ambient-ebpf trace --since` (0: trace only while someone traces, the hot path then builds no events)")
	fs.BoolVar(&f.installCNI, "install-cni", true, "install the CNI plugin on the host and keep it installed")
	fs.Var(&f.cniBinDirs, "cni-bin-dir", "host CNI bin directory (repeatable; default /host/opt/cni/bin)")
	fs.StringVar(&f.cniConfDir, "cni-conf-dir", "/host/etc/cni/net.d", "host CNI configuration directory")
	fs.StringVar(&f.cniConfName, "cni-conf-name", "", "write this own conflist instead of chaining into the primary CNI's")
	fs.StringVar(&f.cniOwnedConflist, "cni-owned-conflist", DefaultOwnedConflist, "chain into an owned copy of the primary CNI's configuration with this file name, which must sort before the primary's: it survives a reboot and the primary rewriting its own file (empty: chain into the primary's file in place; --cni-conf-name wins)")
	fs.StringVar(&f.pluginBinary, "cni-plugin-binary", "/usr/local/bin/ambient-ebpf-cni", "the plugin binary to install")
	fs.StringVar(&f.cniKubeconfig, "cni-kubeconfig", "", "where the agent writes the plugin's kubeconfig (default <cni-conf-dir>/ambient-ebpf-cni.kubeconfig)")
	fs.StringVar(&f.hostRoot, "host-root", "/host", "where host directories are mounted; stripped from paths the plugin reads on the host")
	fs.StringVar(&f.tokenPath, "token-path", "/var/run/secrets/kubernetes.io/serviceaccount/token", "service-account token the plugin's kubeconfig carries")
	fs.StringVar(&f.caPath, "ca-path", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt", "API server CA for the plugin's kubeconfig")
	fs.StringVar(&f.apiServer, "api-server", "", "API server URL as the host sees it (default from KUBERNETES_SERVICE_HOST/PORT)")
	fs.StringVar(&f.excluded, "excluded-namespaces", "kube-system", "comma-separated namespaces whose pods are never enrolled")
	fs.StringVar(&f.systemNamespace, "system-namespace", envOr("SYSTEM_NAMESPACE", enrollment.DefaultSystemNamespace), "Istio's system namespace, where ztunnel's pods (app=ztunnel) are never enrolled, as istio-cni's SYSTEM_NAMESPACE; default $SYSTEM_NAMESPACE, else istio-system")
	fs.StringVar(&f.selectors, "enablement-selectors", "", "istio-cni's ambient enablement selectors, a JSON or YAML list of {podSelector, namespaceSelector}; a pod is ambient when one matches (empty: the istio.io/dataplane-mode label rule)")
	fs.BoolVar(&f.dnsCapture, "dns-capture", true, "capture DNS to ztunnel's proxy (per pod: ambient.istio.io/dns-capture)")
	fs.StringVar(&f.sockmapAccel, "sockmap-accel", envOr("AMBIENT_EBPF_SOCKMAP_ACCEL", string(accel.Off)), "sockmap acceleration of the app <-> ztunnel hop in each pod (Linux 5.15): off, ztunnel (the app's sends into ztunnel skip TCP) or both (ztunnel's into the app too; apps reading with splice(2) miss those bytes); default $AMBIENT_EBPF_SOCKMAP_ACCEL, else off (see docs/BENCHMARKS.md)")
	fs.StringVar(&f.repairMode, "repair-mode", "repair", "unredirected running ambient pods: repair (in place), delete, label or off")
	fs.StringVar(&f.dsNamespace, "daemonset-namespace", os.Getenv("POD_NAMESPACE"), "the agent's DaemonSet namespace (uninstall check)")
	fs.StringVar(&f.dsName, "daemonset-name", "", "the agent's DaemonSet; while it exists, shutdown keeps all state")
	fs.BoolVar(&f.uninstallOnExit, "uninstall-on-exit", false, "remove everything on shutdown (standalone nodes, the demo)")
	fs.BoolVar(&f.istioCNITakeover, "istio-cni-takeover", true, "take running pods over from istio-cni in place: a pod holding exactly istio-cni's in-pod rules is enrolled in eBPF, then its rules (and the node's probe rule once no pod needs it) are removed; a pod holding other rules stays on them (needs the iptables and nft binaries)")
	fs.StringVar(&f.istioCNIHandBack, "istio-cni-handback", "", "on uninstall, hand every pod back to istio-cni first: write istio-cni's exact rules in this backend (iptables-legacy or iptables-nft) before removing the data path; empty: an uninstall only removes")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&f.logFormat, "log-format", "text", "text (key=value) or json (one JSON object a line)")
	fs.BoolVar(&f.version, "version", false, "print the version (from the binary's build information) and exit")
	return f
}

// Version reports whether --version was given: print the version, do nothing else.
func (f *Flags) Version() bool { return f.version }

// Logger builds the logger the flags ask for.
func (f *Flags) Logger() (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level: %w", err)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch f.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", f.logFormat)
}

// Config validates the flags and builds the agent's Config.
func (f *Flags) Config() (Config, error) {
	log, err := f.Logger()
	if err != nil {
		return Config{}, err
	}
	c := Config{
		Logger:   log,
		NodeName: f.nodeName, Kubeconfig: f.kubeconfig, StandalonePods: f.standalone,
		ZDSSocket: f.zdsSocket, CNISocket: f.cniSocket, InspectSocket: f.inspectSocket, ProcRoot: f.procRoot,
		HealthAddr: f.healthAddr, MetricsAddr: f.metricsAddr, PerPodMetrics: f.perPodMetrics,
		TraceHistory:       f.traceHistory,
		DaemonSetNamespace: f.dsNamespace, DaemonSetName: f.dsName, UninstallOnExit: f.uninstallOnExit,
	}
	c.IstioCNITakeover = f.istioCNITakeover
	switch b := istiocni.Backend(f.istioCNIHandBack); b {
	case "", istiocni.Legacy, istiocni.NftCompat:
		c.IstioCNIHandBack = b
	case istiocni.Nftables:
		// Its node table (the host probe rule in nftables) is not
		// rendered: a hand-back would leave kubelet's probes unSNATed.
		return c, fmt.Errorf("--istio-cni-handback %q: istio-cni's native nftables mode is taken over, not handed back to; want %s or %s", b, istiocni.Legacy, istiocni.NftCompat)
	default:
		return c, fmt.Errorf("--istio-cni-handback %q: want %s or %s", f.istioCNIHandBack, istiocni.Legacy, istiocni.NftCompat)
	}
	if f.traceHistory < 0 {
		return c, fmt.Errorf("--trace-history %s: want a duration of 0 or more", f.traceHistory)
	}
	c.Dataplane = dataplane.Config{BPFFSDir: f.bpffs, CgroupRoot: f.cgroupRoot, NodeNetns: f.nodeNetns, ProcRoot: f.procRoot}
	if c.Dataplane.Failpoint, err = failpointFromEnv(); err != nil {
		return c, err
	}
	if c.Dataplane.ProbeV4, err = netip.ParseAddr(f.probeV4); err != nil {
		return c, fmt.Errorf("--probe-snat-v4: %w", err)
	}
	if c.Dataplane.ProbeV6, err = netip.ParseAddr(f.probeV6); err != nil {
		return c, fmt.Errorf("--probe-snat-v6: %w", err)
	}
	if c.Dataplane.HostProbes, err = bpfobj.ParseProbeMode(f.hostProbes); err != nil {
		return c, fmt.Errorf("--host-probes: %w", err)
	}
	if c.Dataplane.SockmapAccel, err = accel.ParseMode(f.sockmapAccel); err != nil {
		return c, fmt.Errorf("--sockmap-accel: %w", err)
	}
	if c.Dataplane.CgroupRoot == "" {
		if c.Dataplane.CgroupRoot, err = hostfs.Cgroup2Root(); err != nil {
			return c, fmt.Errorf("find the cgroup v2 hierarchy (set --cgroup-root): %w", err)
		}
	}
	switch f.podsCgroup {
	case "none", "":
	case "auto":
		c.Dataplane.PodsCgroup = hostfs.PodsCgroup(c.Dataplane.CgroupRoot)
	default:
		c.Dataplane.PodsCgroup = f.podsCgroup
		if !filepath.IsAbs(f.podsCgroup) {
			c.Dataplane.PodsCgroup = filepath.Join(c.Dataplane.CgroupRoot, f.podsCgroup)
		}
	}
	switch c.Dataplane.SocketHooks = dataplane.SocketHooks(f.socketHooks); c.Dataplane.SocketHooks {
	case dataplane.SocketHooksShared:
	case dataplane.SocketHooksPods:
		if c.Dataplane.PodsCgroup == "" {
			return c, fmt.Errorf("--socket-hooks=pods needs a pods cgroup: --pods-cgroup=%s found none below %s", f.podsCgroup, c.Dataplane.CgroupRoot)
		}
	default:
		return c, fmt.Errorf("--socket-hooks=%s: want shared or pods", f.socketHooks)
	}
	c.Enrollment = enrollment.DefaultConfig()
	c.Enrollment.DNSCapture = f.dnsCapture
	c.Enrollment.ExcludedNamespaces = nil
	c.Enrollment.ZtunnelNamespace = f.systemNamespace
	for _, ns := range strings.Split(f.excluded, ",") {
		if ns = strings.TrimSpace(ns); ns != "" {
			c.Enrollment.ExcludedNamespaces = append(c.Enrollment.ExcludedNamespaces, ns)
		}
	}
	if f.selectors != "" {
		if c.Enrollment.Selectors, err = enrollment.ParseSelectors([]byte(f.selectors)); err != nil {
			return c, fmt.Errorf("--enablement-selectors: %w", err)
		}
	}
	switch f.repairMode {
	case "repair", "inplace":
		c.Repair.Mode = kube.RepairInPlace
	case "delete":
		c.Repair.Mode = kube.RepairDelete
	case "label":
		c.Repair.Mode = kube.RepairLabel
	case "off":
		c.Repair.Mode = kube.RepairOff
	default:
		return c, fmt.Errorf("--repair-mode %q: want repair, delete, label or off", f.repairMode)
	}
	if f.installCNI {
		bins := []string(f.cniBinDirs)
		if len(bins) == 0 {
			bins = []string{"/host/opt/cni/bin"}
		}
		if n := f.cniOwnedConflist; n != "" && (filepath.Base(n) != n || filepath.Ext(n) != ".conflist") {
			return c, fmt.Errorf("--cni-owned-conflist %q: want a file name ending in .conflist", n)
		}
		ic := &install.Config{PluginBinary: f.pluginBinary, BinDirs: bins, ConfDir: f.cniConfDir, OwnConflist: f.cniConfName,
			OwnedConflist: f.cniOwnedConflist}
		ic.Plugin.AgentSocket = f.cniSocket
		ic.Plugin.ExcludeNamespaces = c.Enrollment.ExcludedNamespaces
		ic.Plugin.ZtunnelNamespace = c.Enrollment.ZtunnelNamespace
		if len(c.Enrollment.Selectors) > 0 {
			sel, err := json.Marshal(c.Enrollment.Selectors)
			if err != nil {
				return c, fmt.Errorf("--enablement-selectors: %w", err)
			}
			ic.Plugin.EnablementSelectors = sel
		}
		ic.Plugin.AgentNamespace = f.dsNamespace
		ic.Plugin.AgentPodPrefix = f.dsName
		if f.standalone != "" {
			ic.Plugin.PodFile = f.standalone
		} else {
			ic.KubeconfigPath = f.cniKubeconfig
			if ic.KubeconfigPath == "" {
				ic.KubeconfigPath = f.cniConfDir + "/ambient-ebpf-cni.kubeconfig"
			}
			if f.hostRoot != "" && strings.HasPrefix(ic.KubeconfigPath, f.hostRoot+"/") {
				ic.KubeconfigHostPath = strings.TrimPrefix(ic.KubeconfigPath, f.hostRoot)
			}
			ic.TokenPath, ic.CAPath, ic.APIServer = f.tokenPath, f.caPath, f.apiServer
			if ic.APIServer == "" {
				if h, p := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT"); h != "" {
					ic.APIServer = "https://" + net.JoinHostPort(h, p)
				}
			}
		}
		c.Install = ic
	}
	return c, nil
}

// envOr is the environment variable's value, or def when it is unset.
func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}
