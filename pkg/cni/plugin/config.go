// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"encoding/json"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

// PluginType is the "type" of our entry in a conflist, and the binary name.
const PluginType = "ambient-ebpf-cni"

// SupportedVersions returns the CNI spec versions the plugin speaks.
func SupportedVersions() []string { return []string{"0.3.1", "0.4.0", "1.0.0", "1.1.0"} }

// VersionInfo returns the plugin's CNI version information.
func VersionInfo() version.PluginInfo { return version.PluginSupports(SupportedVersions()...) }

// Defaults for the plugin configuration.
const (
	DefaultAgentTimeout    = 5 * time.Second
	DefaultFallbackTimeout = 3 * time.Second
)

// Settings are the plugin's own fields in its conflist entry; the installer
// writes them (see pkg/cni/install).
type Settings struct {
	// AgentSocket is the agent's unix socket. Default events.DefaultSocketPath.
	AgentSocket string `json:"agentSocket,omitempty"`
	// AgentTimeout bounds one call to the agent, as a Go duration. Default 5s.
	AgentTimeout string `json:"agentTimeout,omitempty"`
	// Kubeconfig is the narrow kubeconfig the installer wrote; with it the
	// plugin reads the pod and its namespace when the agent is down.
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// PodFile is the standalone pod file, used instead of the API when set.
	PodFile string `json:"podFile,omitempty"`
	// ExcludeNamespaces never hold ambient pods. Default kube-system.
	ExcludeNamespaces []string `json:"excludeNamespaces,omitempty"`
	// AgentNamespace and AgentPodPrefix name the agent's own pods, which pass
	// through without asking anyone (the agent may be the one starting).
	AgentNamespace string `json:"agentNamespace,omitempty"`
	AgentPodPrefix string `json:"agentPodPrefix,omitempty"`
	// SelfLabels and ZtunnelLabels override the enrollment defaults used by
	// the fallback decision.
	SelfLabels    map[string]string `json:"selfLabels,omitempty"`
	ZtunnelLabels map[string]string `json:"ztunnelLabels,omitempty"`
	// ZtunnelNamespace is where ztunnel's pods are (enrollment.Config);
	// empty: the default, istio-system.
	ZtunnelNamespace string `json:"ztunnelNamespace,omitempty"`
	// EnablementSelectors, when set, are the agent's enablement selectors,
	// so the fallback decides as the agent would.
	// They are passed to the fallback as they are (the plugin does not link
	// the Kubernetes types they are made of).
	EnablementSelectors json.RawMessage `json:"enablementSelectors,omitempty"`
}

// Config is the plugin's entry in the conflist as the plugin receives it:
// what the runtime injects (cniVersion, name, prevResult) plus Settings.
type Config struct {
	types.PluginConf
	Settings

	agentTimeout time.Duration
}

// ParseConfig decodes and validates the plugin's stdin. Errors are
// *types.Error with the spec's codes: 6 for undecodable input, 1 for an
// unsupported cniVersion, 7 for an invalid field. The prevResult, when
// present, is parsed into PrevResult; whether it is required depends on the
// command.
func ParseConfig(stdin []byte) (*Config, error) {
	conf := &Config{}
	if err := json.Unmarshal(stdin, conf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "decode network configuration", err.Error())
	}
	if !slices.Contains(SupportedVersions(), conf.CNIVersion) {
		return nil, types.NewError(types.ErrIncompatibleCNIVersion, "unsupported cniVersion",
			fmt.Sprintf("config has cniVersion %q, plugin supports %s", conf.CNIVersion, strings.Join(SupportedVersions(), ", ")))
	}
	if err := version.ParsePrevResult(&conf.PluginConf); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "decode prevResult", err.Error())
	}
	if conf.AgentSocket == "" {
		conf.AgentSocket = events.DefaultSocketPath
	}
	conf.agentTimeout = DefaultAgentTimeout
	if conf.AgentTimeout != "" {
		d, err := time.ParseDuration(conf.AgentTimeout)
		if err != nil || d <= 0 {
			return nil, types.NewError(types.ErrInvalidNetworkConfig, "invalid agentTimeout",
				fmt.Sprintf("agentTimeout %q must be a positive duration such as 5s", conf.AgentTimeout))
		}
		conf.agentTimeout = d
	}
	if conf.ExcludeNamespaces == nil {
		conf.ExcludeNamespaces = slices.Clone(defaultExcludedNamespaces)
	}
	return conf, nil
}

// hasFallback reports whether the plugin can decide by itself when the
// agent is down.
func (c *Config) hasFallback() bool { return c.PodFile != "" || c.Kubeconfig != "" }

// passesWithoutAgent reports the pods that never need the agent: pods in
// excluded namespaces and the agent's own pods.
func (c *Config) passesWithoutAgent(p *cniv1.Pod) (string, bool) {
	if slices.Contains(c.ExcludeNamespaces, p.GetNamespace()) {
		return reasonExcludedNS, true
	}
	if c.AgentNamespace != "" && c.AgentPodPrefix != "" &&
		p.GetNamespace() == c.AgentNamespace && strings.HasPrefix(p.GetName(), c.AgentPodPrefix) {
		return reasonSelf, true
	}
	return "", false
}

// k8sArgs are the CNI_ARGS keys the plugin reads.
type k8sArgs struct {
	Namespace, Name, UID, InfraContainerID string
}

// parseCNIArgs reads the Kubernetes identity from CNI_ARGS
// ("K8S_POD_NAMESPACE=a;K8S_POD_NAME=b;K8S_POD_UID=c;..."). Unknown keys and
// pairs without '=' are ignored; one of the plugin's keys given twice is
// refused, so two readers of the same CNI_ARGS cannot see different pods.
// The values are checked by podFromArgs.
func parseCNIArgs(s string) (k8sArgs, error) {
	var a k8sArgs
	fields := map[string]*string{
		"K8S_POD_NAME":               &a.Name,
		"K8S_POD_NAMESPACE":          &a.Namespace,
		"K8S_POD_UID":                &a.UID,
		"K8S_POD_INFRA_CONTAINER_ID": &a.InfraContainerID,
	}
	seen := map[string]bool{}
	for kv := range strings.SplitSeq(s, ";") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			continue
		}
		k = strings.TrimSpace(k)
		dst := fields[k]
		if dst == nil {
			continue
		}
		if seen[k] {
			return k8sArgs{}, fmt.Errorf("cni_args: %s given twice", k)
		}
		seen[k] = true
		*dst = v
	}
	return a, nil
}

// podFromArgs returns the pod a command is about, every identity in it
// checked (pkg/validate): the names and UID from CNI_ARGS, the container ID,
// the interface and, when given (DEL may come without it) or for an ADD, the
// netns path. ok is false when CNI_ARGS names no Kubernetes pod. Errors are
// *types.Error with code 4 (invalid environment variables).
func podFromArgs(args *skel.CmdArgs, add bool) (pod *cniv1.Pod, ok bool, err error) {
	invalid := func(err error) error {
		return types.NewError(types.ErrInvalidEnvironmentVariables, err.Error(),
			"ambient-ebpf-cni refuses pod, sandbox and interface names that Kubernetes or Linux would refuse")
	}
	k, err := parseCNIArgs(args.Args)
	if err != nil {
		return nil, false, invalid(err)
	}
	if k.Name == "" && k.Namespace == "" {
		return nil, false, nil
	}
	checks := []func() error{
		func() error { return validate.PodNames(k.Namespace, k.Name) },
		func() error { return validate.ContainerID(args.ContainerID) },
		func() error { return validate.Interface(args.IfName) },
	}
	if k.UID != "" {
		checks = append(checks, func() error { return validate.PodUID(k.UID) })
	}
	if k.InfraContainerID != "" {
		checks = append(checks, func() error { return validate.InfraContainerID(k.InfraContainerID) })
	}
	if add || args.Netns != "" {
		checks = append(checks, func() error { return validate.NetnsPath(args.Netns) })
	}
	for _, check := range checks {
		if err := check(); err != nil {
			return nil, false, invalid(err)
		}
	}
	return &cniv1.Pod{Name: k.Name, Namespace: k.Namespace, Uid: k.UID,
		ContainerId: args.ContainerID, Netns: args.Netns, Interface: args.IfName}, true, nil
}

// prevIPs returns the addresses in the previous result, without prefix
// length, container-side ones only when interfaces are listed.
func prevIPs(prev types.Result) ([]string, error) {
	res, err := current.NewResultFromResult(prev)
	if err != nil {
		return nil, fmt.Errorf("convert prevResult: %w", err)
	}
	var ips []string
	for _, ip := range res.IPs {
		if ip.Interface != nil && *ip.Interface >= 0 && *ip.Interface < len(res.Interfaces) &&
			res.Interfaces[*ip.Interface].Sandbox == "" {
			continue // a host-side address, not the pod's
		}
		if ip.Address.IP == nil {
			continue
		}
		ips = append(ips, canonicalIP(ip.Address.IP))
	}
	return ips, nil
}

func canonicalIP(ip net.IP) string {
	if v4 := ip.To4(); v4 != nil {
		return v4.String()
	}
	return ip.String()
}
