// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
	"sigs.k8s.io/yaml"

	"github.com/ambient-ebpf/ambient-ebpf/test/helmrender"
)

// Release is how the suite installs the chart.
const (
	ReleaseName      = "ambient-ebpf"
	ReleaseNamespace = "istio-system"
)

// Chart is one rendering of deploy/ambient-ebpf, decoded.
type Chart struct {
	Objects   []k8sruntime.Object // in render order, every kind
	DaemonSet *appsv1.DaemonSet
}

// RenderChart renders the chart at dir as `helm template` does, with
// values (YAML) over its values.yaml.
func RenderChart(dir, values string) (*Chart, error) {
	objs, err := helmrender.Render(dir, helmrender.Release{Name: ReleaseName, Namespace: ReleaseNamespace, Strict: true}, values,
		"serviceaccount.yaml", "rbac.yaml", "daemonset.yaml")
	if err != nil {
		return nil, err
	}
	c := &Chart{Objects: objs, DaemonSet: helmrender.DaemonSet(objs)}
	if c.DaemonSet == nil {
		return nil, errors.New("the chart renders no DaemonSet")
	}
	return c, nil
}

// ChartValues are the chart values that put the agent on this node: its
// host paths are the node's per-run ones, the image is the one built here,
// and the plugin is chained into the primary conflist in place, where
// TestNode looks for it (not the chart's default owned conflist).
func (n *Node) ChartValues(extra string) string { return n.chartValues(`""`, extra) }

// OwnedChartValues are ChartValues with the chart's default owned
// conflist (OwnedConflist), which a reboot leaves in place.
func (n *Node) OwnedChartValues(extra string) string { return n.chartValues(OwnedConflist, extra) }

// OwnedConflist is the chart's default cni.ownedConflist.
const OwnedConflist = "00-ambient-ebpf.conflist"

func (n *Node) chartValues(owned, extra string) string {
	return fmt.Sprintf(`image: {repository: %q, tag: %q, pullPolicy: Never}
hostPaths:
  bpffs: %q
  cgroup: %q
  netns: %q
  ztunnelSocketDir: %q
  runDir: %q
cni:
  binDirs: [%q]
  confDir: %q
  ownedConflist: %s
`, strings.Split(ProjectImage, ":")[0], strings.Split(ProjectImage, ":")[1], n.BPFFS, n.Cgroup2, n.NetnsDir,
		n.ZtunnelSocketDir(), filepath.Join(n.Dir, "ambient-ebpf"), n.CNIBin, n.CNIConf, owned) + extra
}

// ZtunnelSocketDir is the host directory of ztunnel's ZDS socket.
func (n *Node) ZtunnelSocketDir() string { return filepath.Join(n.Dir, "ztunnel") }

// PodContext is what kubelet knows of a DaemonSet pod when it makes its
// containers: the downward API's values and the service-account volume.
type PodContext struct {
	PodSpec
	NodeName, HostIP string
	// ServiceAccountDir holds token, ca.crt and namespace; mounted where
	// kubelet projects them.
	ServiceAccountDir string
	// Env is added to the container's environment (KUBERNETES_SERVICE_*).
	Env map[string]string
}

// FromDaemonSet translates the DaemonSet's pod template into the CRI
// sandbox and container kubelet would ask the runtime for: host network,
// the container's command, arguments ($(VAR) expanded) and environment
// (downward API), its volume mounts with their propagation (host paths
// made as their type says, emptyDir as a tmpfs), and its securityContext
// field by field. A field it does not know fails, so the chart cannot
// grow a setting that the suite silently leaves out.
func (n *Node) FromDaemonSet(ds *appsv1.DaemonSet, pc PodContext) (*cri.PodSandboxConfig, *cri.ContainerConfig, error) {
	ps := ds.Spec.Template.Spec
	if len(ps.Containers) != 1 || len(ps.InitContainers) != 0 {
		return nil, nil, fmt.Errorf("daemonset: %d containers, %d init containers: want one container", len(ps.Containers), len(ps.InitContainers))
	}
	if ps.HostPID || ps.HostIPC || ps.ShareProcessNamespace != nil || ps.SecurityContext != nil && !isZero(ps.SecurityContext) {
		return nil, nil, errors.New("daemonset: pod-level hostPID, hostIPC, shareProcessNamespace or securityContext not translated")
	}
	pc.HostNetwork = ps.HostNetwork
	sb := n.SandboxConfig(pc.PodSpec)
	c := ps.Containers[0]

	env := map[string]string{}
	var envs []*cri.KeyValue
	for _, e := range c.Env {
		v, err := n.envValue(e, pc)
		if err != nil {
			return nil, nil, fmt.Errorf("env %s: %w", e.Name, err)
		}
		env[e.Name] = v
		envs = append(envs, &cri.KeyValue{Key: e.Name, Value: []byte(v)})
	}
	for k, v := range pc.Env {
		env[k] = v
		envs = append(envs, &cri.KeyValue{Key: k, Value: []byte(v)})
	}
	expand := func(s string) string {
		for k, v := range env {
			s = strings.ReplaceAll(s, "$("+k+")", v)
		}
		return s
	}
	var args []string
	for _, a := range c.Args {
		args = append(args, expand(a))
	}

	vols := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		vols[v.Name] = v
	}
	var mounts []*cri.Mount
	for _, vm := range c.VolumeMounts {
		v, ok := vols[vm.Name]
		if !ok {
			return nil, nil, fmt.Errorf("volume mount %s: no such volume", vm.Name)
		}
		host, err := n.volumeSource(v, pc)
		if err != nil {
			return nil, nil, err
		}
		prop := cri.MountPropagation_PROPAGATION_PRIVATE
		if vm.MountPropagation != nil {
			switch *vm.MountPropagation {
			case corev1.MountPropagationHostToContainer:
				prop = cri.MountPropagation_PROPAGATION_HOST_TO_CONTAINER
			case corev1.MountPropagationBidirectional:
				prop = cri.MountPropagation_PROPAGATION_BIDIRECTIONAL
			case corev1.MountPropagationNone:
			default:
				return nil, nil, fmt.Errorf("volume mount %s: propagation %s", vm.Name, *vm.MountPropagation)
			}
		}
		if vm.SubPath != "" || vm.SubPathExpr != "" {
			return nil, nil, fmt.Errorf("volume mount %s: subPath not translated", vm.Name)
		}
		mounts = append(mounts, &cri.Mount{ContainerPath: vm.MountPath, HostPath: host, Readonly: vm.ReadOnly, Propagation: prop})
	}
	if pc.ServiceAccountDir != "" && (ps.AutomountServiceAccountToken == nil || *ps.AutomountServiceAccountToken) {
		mounts = append(mounts, &cri.Mount{ContainerPath: "/var/run/secrets/kubernetes.io/serviceaccount", HostPath: pc.ServiceAccountDir, Readonly: true})
	}

	sc, err := securityContext(c.SecurityContext)
	if err != nil {
		return nil, nil, err
	}
	if ps.HostNetwork {
		sc.NamespaceOptions = &cri.NamespaceOption{Network: cri.NamespaceMode_NODE, Pid: cri.NamespaceMode_CONTAINER, Ipc: cri.NamespaceMode_POD}
	}
	res := &cri.LinuxContainerResources{CpuShares: 2}
	if cpu, ok := c.Resources.Requests[corev1.ResourceCPU]; ok {
		res.CpuShares = max(2, cpu.MilliValue()*1024/1000)
	}
	if mem, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		res.MemoryLimitInBytes = mem.Value()
	}
	cc := &cri.ContainerConfig{
		Metadata: &cri.ContainerMetadata{Name: c.Name},
		Image:    &cri.ImageSpec{Image: c.Image},
		Command:  c.Command,
		Args:     args,
		Envs:     envs,
		Mounts:   mounts,
		LogPath:  c.Name + ".log",
		Linux:    &cri.LinuxContainerConfig{SecurityContext: sc, Resources: res},
	}
	return sb, cc, nil
}

// profile translates a seccomp or AppArmor profile type (the two share
// their names) into CRI's field and the deprecated string form.
func profile(typ string) (*cri.SecurityProfile, string, error) {
	switch typ {
	case "RuntimeDefault":
		return &cri.SecurityProfile{ProfileType: cri.SecurityProfile_RuntimeDefault}, "runtime/default", nil
	case "Unconfined":
		return &cri.SecurityProfile{ProfileType: cri.SecurityProfile_Unconfined}, "unconfined", nil
	}
	return nil, "", fmt.Errorf("profile type %s not translated", typ)
}

func isZero(psc *corev1.PodSecurityContext) bool {
	b, _ := yaml.Marshal(psc)
	return strings.TrimSpace(string(b)) == "{}"
}

func (n *Node) envValue(e corev1.EnvVar, pc PodContext) (string, error) {
	switch {
	case e.ValueFrom == nil:
		return e.Value, nil
	case e.ValueFrom.FieldRef != nil:
		switch e.ValueFrom.FieldRef.FieldPath {
		case "spec.nodeName":
			return pc.NodeName, nil
		case "metadata.namespace":
			return pc.Namespace, nil
		case "metadata.name":
			return pc.Name, nil
		case "status.hostIP":
			return pc.HostIP, nil
		}
		return "", fmt.Errorf("fieldRef %s not translated", e.ValueFrom.FieldRef.FieldPath)
	case e.ValueFrom.ResourceFieldRef != nil:
		// No limit is set: kubelet gives the node's allocatable.
		switch e.ValueFrom.ResourceFieldRef.Resource {
		case "limits.memory":
			return strconv.FormatInt(nodeMemory(), 10), nil
		case "limits.cpu":
			return strconv.Itoa(runtime.NumCPU()), nil
		}
		return "", fmt.Errorf("resourceFieldRef %s not translated", e.ValueFrom.ResourceFieldRef.Resource)
	}
	return "", errors.New("valueFrom not translated")
}

func nodeMemory() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return math.MaxInt64
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemTotal:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb * 1024
		}
	}
	return math.MaxInt64
}

// volumeSource returns the host directory behind a volume, made as
// kubelet makes it.
func (n *Node) volumeSource(v corev1.Volume, pc PodContext) (string, error) {
	switch {
	case v.HostPath != nil:
		t := corev1.HostPathUnset
		if v.HostPath.Type != nil {
			t = *v.HostPath.Type
		}
		switch t {
		case corev1.HostPathDirectoryOrCreate:
			if err := os.MkdirAll(v.HostPath.Path, 0o755); err != nil {
				return "", fmt.Errorf("volume %s: %w", v.Name, err)
			}
		case corev1.HostPathDirectory:
			if fi, err := os.Stat(v.HostPath.Path); err != nil || !fi.IsDir() {
				return "", fmt.Errorf("volume %s: hostPath %s is not a directory", v.Name, v.HostPath.Path)
			}
		case corev1.HostPathUnset:
		default:
			return "", fmt.Errorf("volume %s: hostPath type %s not translated", v.Name, t)
		}
		return v.HostPath.Path, nil
	case v.EmptyDir != nil:
		dir := filepath.Join(n.Dir, "volumes", pc.UID, v.Name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
		if v.EmptyDir.Medium == corev1.StorageMediumMemory {
			opts := "mode=0755"
			if v.EmptyDir.SizeLimit != nil {
				opts += ",size=" + strconv.FormatInt(v.EmptyDir.SizeLimit.Value(), 10)
			}
			if !n.mounted(dir) {
				if err := n.mount("tmpfs", dir, "tmpfs", 0, opts); err != nil {
					return "", fmt.Errorf("volume %s: %w", v.Name, err)
				}
			}
		}
		return dir, nil
	}
	return "", fmt.Errorf("volume %s: only hostPath and emptyDir are translated", v.Name)
}

func (n *Node) mounted(dir string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, m := range n.mounts {
		if m == dir {
			return true
		}
	}
	return false
}

// securityContext is kubelet's translation of a container securityContext
// (pkg/kubelet/kuberuntime/security_context.go) for the fields the chart
// may set; any other set field is an error.
func securityContext(sc *corev1.SecurityContext) (*cri.LinuxContainerSecurityContext, error) {
	var err error
	out := &cri.LinuxContainerSecurityContext{}
	if sc == nil {
		out.MaskedPaths, out.ReadonlyPaths = defaultMaskedPaths, defaultReadonlyPaths
		return out, nil
	}
	rest := sc.DeepCopy()
	if sc.Privileged != nil {
		out.Privileged = *sc.Privileged
		rest.Privileged = nil
	}
	if sc.Capabilities != nil {
		out.Capabilities = &cri.Capability{}
		for _, c := range sc.Capabilities.Add {
			out.Capabilities.AddCapabilities = append(out.Capabilities.AddCapabilities, string(c))
		}
		for _, c := range sc.Capabilities.Drop {
			out.Capabilities.DropCapabilities = append(out.Capabilities.DropCapabilities, string(c))
		}
		rest.Capabilities = nil
	}
	if sc.RunAsUser != nil {
		out.RunAsUser = &cri.Int64Value{Value: *sc.RunAsUser}
		rest.RunAsUser = nil
	}
	if sc.RunAsGroup != nil {
		out.RunAsGroup = &cri.Int64Value{Value: *sc.RunAsGroup}
		rest.RunAsGroup = nil
	}
	rest.RunAsNonRoot = nil // checked by kubelet against the image's user: uid 0 and false agree
	if sc.ReadOnlyRootFilesystem != nil {
		out.ReadonlyRootfs = *sc.ReadOnlyRootFilesystem
		rest.ReadOnlyRootFilesystem = nil
	}
	if sc.AllowPrivilegeEscalation != nil {
		out.NoNewPrivs = !*sc.AllowPrivilegeEscalation
		rest.AllowPrivilegeEscalation = nil
	}
	if p := sc.SeccompProfile; p != nil {
		if out.Seccomp, out.SeccompProfilePath, err = profile(string(p.Type)); err != nil {
			return nil, fmt.Errorf("seccompProfile: %w", err)
		}
		rest.SeccompProfile = nil
	}
	if p := sc.AppArmorProfile; p != nil {
		// Kubelet sets the deprecated field too, for runtimes like this
		// containerd 1.6.
		if out.Apparmor, out.ApparmorProfile, err = profile(string(p.Type)); err != nil {
			return nil, fmt.Errorf("appArmorProfile: %w", err)
		}
		rest.AppArmorProfile = nil
	}
	if sc.SELinuxOptions != nil && *sc.SELinuxOptions == (corev1.SELinuxOptions{}) {
		rest.SELinuxOptions = nil
	}
	if !out.Privileged {
		out.MaskedPaths, out.ReadonlyPaths = defaultMaskedPaths, defaultReadonlyPaths
	}
	if b, _ := yaml.Marshal(rest); strings.TrimSpace(string(b)) != "{}" {
		return nil, fmt.Errorf("securityContext fields not translated: %s", b)
	}
	return out, nil
}
