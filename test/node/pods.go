// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// PodSpec is what the suite asks the runtime for, as kubelet would from a
// pod object: the sandbox's metadata carries the pod's name, namespace and
// uid, which the runtime passes to the CNI chain (K8S_POD_*).
type PodSpec struct {
	Name, Namespace, UID string
	HostNetwork          bool
}

// Pod is a sandbox the runtime made.
type Pod struct {
	PodSpec
	ID  string // sandbox id
	IP  netip.Addr
	cfg *cri.PodSandboxConfig
	// Containers by name: container ids.
	Containers map[string]string
}

func (n *Node) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 2*time.Minute)
}

// SandboxConfig is the sandbox kubelet would ask for: in the node's cgroup
// subtree, logs in the node's directory.
func (n *Node) SandboxConfig(spec PodSpec) *cri.PodSandboxConfig {
	netMode := cri.NamespaceMode_POD
	if spec.HostNetwork {
		netMode = cri.NamespaceMode_NODE
	}
	hostname := spec.Name
	if spec.HostNetwork {
		hostname = "" // the node's, as kubelet leaves it
	}
	return &cri.PodSandboxConfig{
		Metadata:     &cri.PodSandboxMetadata{Name: spec.Name, Namespace: spec.Namespace, Uid: spec.UID},
		Hostname:     hostname,
		LogDirectory: filepath.Join(n.Dir, "logs", spec.UID),
		Labels: map[string]string{
			"io.kubernetes.pod.name": spec.Name, "io.kubernetes.pod.namespace": spec.Namespace, "io.kubernetes.pod.uid": spec.UID,
		},
		Linux: &cri.LinuxPodSandboxConfig{
			CgroupParent: n.CgroupParent + "/pod" + spec.UID,
			SecurityContext: &cri.LinuxSandboxSecurityContext{
				NamespaceOptions: &cri.NamespaceOption{Network: netMode, Pid: cri.NamespaceMode_CONTAINER, Ipc: cri.NamespaceMode_POD},
			},
		},
	}
}

// RunPod creates the pod's sandbox: the runtime makes its netns and runs
// the CNI chain. The error is the runtime's, as kubelet would report it.
func (n *Node) RunPod(spec PodSpec) (*Pod, error) {
	return n.RunSandbox(spec, n.SandboxConfig(spec))
}

// RunSandbox is RunPod with the sandbox configuration given.
func (n *Node) RunSandbox(spec PodSpec, cfg *cri.PodSandboxConfig) (*Pod, error) {
	if err := os.MkdirAll(cfg.LogDirectory, 0o755); err != nil {
		return nil, err
	}
	ctx, cancel := n.ctx()
	defer cancel()
	resp, err := n.Runtime.RunPodSandbox(ctx, &cri.RunPodSandboxRequest{Config: cfg})
	if err != nil {
		return nil, err
	}
	p := &Pod{PodSpec: spec, ID: resp.PodSandboxId, cfg: cfg, Containers: map[string]string{}}
	st, err := n.Runtime.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: p.ID})
	if err != nil {
		return p, fmt.Errorf("sandbox status of %s: %w", spec.Name, err)
	}
	if ip := st.GetStatus().GetNetwork().GetIp(); ip != "" {
		p.IP, _ = netip.ParseAddr(ip)
	}
	return p, nil
}

// MustRunPod is RunPod that fails the test on error.
func (n *Node) MustRunPod(spec PodSpec) *Pod {
	n.t.Helper()
	p, err := n.RunPod(spec)
	if err != nil {
		n.t.Fatalf("run pod %s/%s: %v\ncontainerd log ends:\n%s", spec.Namespace, spec.Name, err, n.LogTail("containerd.log"))
	}
	return p
}

// SandboxNetns is the netns of the ready sandbox of a pod kubelet runs.
func (n *Node) SandboxNetns(namespace, name string) string {
	n.t.Helper()
	ctx, cancel := n.ctx()
	defer cancel()
	list, err := n.Runtime.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{Filter: &cri.PodSandboxFilter{
		State:         &cri.PodSandboxStateValue{State: cri.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.namespace": namespace, "io.kubernetes.pod.name": name},
	}})
	if err != nil || len(list.Items) != 1 {
		n.t.Fatalf("the sandbox of %s/%s: %v (%d found)", namespace, name, err, len(list.GetItems()))
	}
	return n.NetnsPath(&Pod{ID: list.Items[0].Id})
}

// NetnsPath is the pod's netns as the runtime named it.
func (n *Node) NetnsPath(p *Pod) string {
	n.t.Helper()
	ctx, cancel := n.ctx()
	defer cancel()
	st, err := n.Runtime.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: p.ID, Verbose: true})
	if err != nil {
		n.t.Fatal(err)
	}
	path := sandboxNetns(st.Info["info"])
	if path == "" {
		n.t.Fatalf("sandbox %s has no network namespace in its info: %s", p.Name, st.Info["info"])
	}
	return path
}

// sandboxNetns reads the netns path from a sandbox's verbose info.
func sandboxNetns(info string) string {
	var v struct {
		RuntimeSpec struct {
			Linux struct {
				Namespaces []struct{ Type, Path string }
			}
		}
	}
	if json.Unmarshal([]byte(info), &v) != nil {
		return ""
	}
	for _, ns := range v.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" {
			return ns.Path
		}
	}
	return ""
}

// AppContainer is a container of one of the suite's app images running
// the test app with args.
func AppContainer(name, image string, args ...string) *cri.ContainerConfig {
	return &cri.ContainerConfig{
		Metadata: &cri.ContainerMetadata{Name: name},
		Image:    &cri.ImageSpec{Image: image},
		Command:  append([]string{AppBinary}, args...),
		LogPath:  name + ".log",
		Linux: &cri.LinuxContainerConfig{SecurityContext: &cri.LinuxContainerSecurityContext{
			RunAsUser:     &cri.Int64Value{Value: 1000},
			MaskedPaths:   defaultMaskedPaths,
			ReadonlyPaths: defaultReadonlyPaths,
		}},
	}
}

// StartContainer creates and starts a container in the pod.
func (n *Node) StartContainer(p *Pod, c *cri.ContainerConfig) (string, error) {
	ctx, cancel := n.ctx()
	defer cancel()
	resp, err := n.Runtime.CreateContainer(ctx, &cri.CreateContainerRequest{PodSandboxId: p.ID, Config: c, SandboxConfig: p.cfg})
	if err != nil {
		return "", fmt.Errorf("create container %s in %s: %w", c.Metadata.Name, p.Name, err)
	}
	if _, err := n.Runtime.StartContainer(ctx, &cri.StartContainerRequest{ContainerId: resp.ContainerId}); err != nil {
		return resp.ContainerId, fmt.Errorf("start container %s in %s: %w", c.Metadata.Name, p.Name, err)
	}
	p.Containers[c.Metadata.Name] = resp.ContainerId
	return resp.ContainerId, nil
}

// MustStartContainer is StartContainer that fails the test on error.
func (n *Node) MustStartContainer(p *Pod, c *cri.ContainerConfig) string {
	n.t.Helper()
	id, err := n.StartContainer(p, c)
	if err != nil {
		n.t.Fatal(err)
	}
	return id
}

// KillContainer stops a container with SIGKILL (timeout 0) and removes it,
// as kubelet does before it starts the container again.
func (n *Node) KillContainer(p *Pod, name string, grace time.Duration) {
	n.t.Helper()
	ctx, cancel := n.ctx()
	defer cancel()
	id := p.Containers[name]
	if _, err := n.Runtime.StopContainer(ctx, &cri.StopContainerRequest{ContainerId: id, Timeout: int64(grace / time.Second)}); err != nil {
		n.t.Fatalf("stop container %s: %v", name, err)
	}
	if _, err := n.Runtime.RemoveContainer(ctx, &cri.RemoveContainerRequest{ContainerId: id}); err != nil {
		n.t.Fatalf("remove container %s: %v", name, err)
	}
	delete(p.Containers, name)
}

// ContainerState returns the container's state and exit code.
func (n *Node) ContainerState(id string) (cri.ContainerState, int32) {
	n.t.Helper()
	ctx, cancel := n.ctx()
	defer cancel()
	st, err := n.Runtime.ContainerStatus(ctx, &cri.ContainerStatusRequest{ContainerId: id})
	if err != nil {
		n.t.Fatalf("container status %s: %v", id, err)
	}
	return st.Status.State, st.Status.ExitCode
}

// Exec runs argv in a running container and decodes its stdout (one JSON
// value) into v.
func (n *Node) Exec(p *Pod, container string, v any, argv ...string) {
	n.t.Helper()
	ctx, cancel := n.ctx()
	defer cancel()
	resp, err := n.Runtime.ExecSync(ctx, &cri.ExecSyncRequest{ContainerId: p.Containers[container], Cmd: argv, Timeout: 30})
	if err != nil {
		n.t.Fatalf("exec %v in %s/%s: %v", argv, p.Name, container, err)
	}
	if resp.ExitCode != 0 {
		n.t.Fatalf("exec %v in %s/%s: exit %d: %s%s", argv, p.Name, container, resp.ExitCode, resp.Stdout, resp.Stderr)
	}
	if err := json.Unmarshal(resp.Stdout, v); err != nil {
		n.t.Fatalf("exec %v in %s/%s: decode %q: %v", argv, p.Name, container, resp.Stdout, err)
	}
}

// Log returns the lines a container wrote to stdout and stderr, from the
// log file the runtime writes (CRI format: time stream tag message).
func (n *Node) Log(p *Pod, container string) []string {
	n.t.Helper()
	f, err := os.Open(filepath.Join(p.cfg.LogDirectory, container+".log"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), " ", 4)
		if len(parts) == 4 {
			lines = append(lines, parts[3])
		}
	}
	return lines
}

// RemovePod stops and removes the sandbox (the runtime runs CNI DEL).
func (n *Node) RemovePod(p *Pod) error {
	ctx, cancel := n.ctx()
	defer cancel()
	if _, err := n.Runtime.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: p.ID}); err != nil {
		return fmt.Errorf("stop sandbox %s: %w", p.Name, err)
	}
	if _, err := n.Runtime.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: p.ID}); err != nil {
		return fmt.Errorf("remove sandbox %s: %w", p.Name, err)
	}
	return nil
}

// kubelet's defaults for containers that are not privileged (Default
// procMount), which it sends explicitly over CRI.
var (
	defaultMaskedPaths = []string{
		"/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
	}
	defaultReadonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
)
