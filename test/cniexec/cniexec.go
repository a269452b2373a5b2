// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package cniexec is the container runtime's side of a chained CNI plugin
// for a simulated pod: it execs the plugin the way containerd does through
// libcni (buildOneConfig): its conflist entry with the list's name and
// cniVersion and the primary plugin's result as prevResult on stdin,
// CNI_* and the K8S_POD_* arguments in the environment. The simulated
// node's veth stands for the primary plugin's work. The benchmark
// (test/bench) and the soak (test/soak) run the real plugin through it.
package cniexec

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Pod is a pod as the runtime knows it: its sandbox and what the primary
// CNI gave it.
type Pod struct {
	Name      string       `json:"name"`
	Namespace string       `json:"namespace"`
	UID       string       `json:"uid"`
	Netns     string       `json:"netns"`
	HostVeth  string       `json:"hostVeth"`
	IPs       []netip.Addr `json:"ips"`
}

// FromSimnode is the runtime's view of simulated pods.
func FromSimnode(pods ...*simnode.Pod) []Pod {
	out := make([]Pod, len(pods))
	for i, p := range pods {
		out[i] = Pod{Name: p.Name, Namespace: p.Namespace, UID: p.UID, Netns: p.NetnsPath(), HostVeth: p.HostVeth, IPs: p.IPs()}
	}
	return out
}

// Call is one pod's plugin exec, prepared ahead (the benchmark times the
// exec alone).
type Call struct {
	Pod   Pod
	path  string
	stdin []byte
	env   map[string]invoke.CNIArgs // by command
}

// NewCall prepares the exec of the conflist's plugin of type pluginType,
// found in binDir, for p.
func NewCall(list *libcni.NetworkConfigList, pluginType, binDir string, p Pod) (*Call, error) {
	i := slices.IndexFunc(list.Plugins, func(pc *libcni.PluginConfig) bool { return pc.Network.Type == pluginType })
	if i < 0 {
		return nil, fmt.Errorf("no plugin %s in the conflist %s", pluginType, list.Bytes)
	}
	path, err := invoke.FindInPath(pluginType, []string{binDir})
	if err != nil {
		return nil, err
	}
	conf, err := libcni.InjectConf(list.Plugins[i], map[string]any{"name": list.Name, "cniVersion": list.CNIVersion, "prevResult": prevResult(p, list.CNIVersion)})
	if err != nil {
		return nil, fmt.Errorf("plugin config for %s: %w", p.Name, err)
	}
	c := &Call{Pod: p, path: path, stdin: conf.Bytes, env: map[string]invoke.CNIArgs{}}
	id := "sandbox-" + p.Name
	for _, cmd := range []string{"ADD", "DEL", "VERSION"} {
		args := &invoke.Args{Command: cmd, ContainerID: id, NetNS: p.Netns, IfName: "eth0", Path: binDir,
			PluginArgs: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", p.Namespace}, {"K8S_POD_NAME", p.Name},
				{"K8S_POD_INFRA_CONTAINER_ID", id}, {"K8S_POD_UID", p.UID}}}
		// The runtime's environment, without a helper process's role.
		c.env[cmd] = environ(slices.DeleteFunc(args.AsEnv(), func(kv string) bool { return strings.HasPrefix(kv, simnode.HelperEnv+"=") }))
	}
	return c, nil
}

// prevResult is what a ptp-style primary plugin returns for the pod: the
// host-side veth, eth0 in the sandbox, one address per family on eth0 with
// the node as gateway.
func prevResult(p Pod, version string) *current.Result {
	r := &current.Result{CNIVersion: version, Interfaces: []*current.Interface{{Name: p.HostVeth}, {Name: "eth0", Sandbox: p.Netns}}}
	for _, a := range p.IPs {
		gw := simnode.GatewayV4
		if a.Is6() {
			gw = simnode.GatewayV6
		}
		host := net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(a.BitLen(), a.BitLen())}
		r.IPs = append(r.IPs, &current.IPConfig{Interface: current.Int(1), Address: host, Gateway: gw.AsSlice()})
		r.Routes = append(r.Routes, &types.Route{Dst: net.IPNet{IP: make(net.IP, a.BitLen()/8), Mask: net.CIDRMask(0, a.BitLen())}, GW: gw.AsSlice()})
	}
	return r
}

// environ is a ready environment for invoke.
type environ []string

func (e environ) AsEnv() []string { return e }

// Exec runs the plugin with cmd (ADD, DEL or VERSION) and returns its
// error, which carries the plugin's stderr.
func (c *Call) Exec(ctx context.Context, cmd string) error {
	ex := &invoke.DefaultExec{RawExec: &invoke.RawExec{}}
	var err error
	switch cmd {
	case "ADD":
		_, err = invoke.ExecPluginWithResult(ctx, c.path, c.stdin, c.env[cmd], ex)
	case "DEL":
		err = invoke.ExecPluginWithoutResult(ctx, c.path, c.stdin, c.env[cmd], ex)
	default:
		_, err = ex.ExecPlugin(ctx, c.path, c.stdin, c.env[cmd].AsEnv())
	}
	if err != nil {
		return fmt.Errorf("%s %s/%s: %w", cmd, c.Pod.Namespace, c.Pod.Name, err)
	}
	return nil
}
