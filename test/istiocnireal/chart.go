// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"

	"github.com/ambient-ebpf/ambient-ebpf/test/helmrender"
)

// The release as Istio's docs install it: helm install istio-cni
// istio/cni -n istio-system --set profile=ambient.
const (
	ReleaseName      = "istio-cni"
	ReleaseNamespace = "istio-system"
	AmbientProfile   = "profile: ambient\n"
	// NativeNftablesValues is that install with istio-cni's native
	// nftables backend (global.nativeNftables).
	NativeNftablesValues = AmbientProfile + "global:\n  nativeNftables: true\n"
)

// Chart is istio-cni's chart of go.mod's istio.io/istio, rendered.
type Chart struct {
	Objects   []k8sruntime.Object // service account, cluster roles and bindings, config map, DaemonSet
	DaemonSet *appsv1.DaemonSet
	ConfigMap *corev1.ConfigMap // the install-cni container's envFrom
}

// ChartDir is manifests/charts/istio-cni of the istio.io/istio module
// go.mod requires, in the module cache.
func ChartDir() (string, error) {
	root, err := sourceRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", Module)
	cmd.Dir = root
	out, err := cmd.Output()
	dir := strings.TrimSpace(string(out))
	if err != nil || dir == "" {
		return "", fmt.Errorf("find %s in the module cache (go mod download): %v", Module, err)
	}
	return filepath.Join(dir, "manifests", "charts", "istio-cni"), nil
}

// RenderChart renders istio-cni's chart as `helm template` does, with
// values (YAML; AmbientProfile for the documented install) over its
// values.yaml.
func RenderChart(values string) (*Chart, error) {
	dir, err := ChartDir()
	if err != nil {
		return nil, err
	}
	objs, err := helmrender.Render(dir, helmrender.Release{Name: ReleaseName, Namespace: ReleaseNamespace}, values,
		"serviceaccount.yaml", "clusterrole.yaml", "clusterrolebinding.yaml", "configmap-cni.yaml", "daemonset.yaml")
	if err != nil {
		return nil, err
	}
	c := &Chart{Objects: objs, DaemonSet: helmrender.DaemonSet(objs)}
	for _, o := range objs {
		if cm, ok := o.(*corev1.ConfigMap); ok {
			c.ConfigMap = cm
		}
	}
	if c.DaemonSet == nil || c.ConfigMap == nil {
		return nil, fmt.Errorf("chart %s renders no DaemonSet or no ConfigMap", dir)
	}
	return c, nil
}

// provided says whether Start provides the container's mount at path:
// the DaemonSet's host mounts of the runtime's folders and of /proc (the
// agent's PID namespace's), and the socket folders, given by flag at the
// run's own paths (--cni-agent-run-dir, --ztunnel-uds-address).
func provided(path string) bool {
	switch path {
	case "/host/opt/cni/bin", "/host/etc/cni/net.d", "/host/proc", "/host/var/run/netns", "/var/run/istio-cni", "/var/run/ztunnel":
		return true
	}
	return false
}

// Pod is what the downward API tells the agent of its own pod.
type Pod struct{ NodeName, Name, Namespace string }

// Container is the install-cni container of the DaemonSet as kubelet
// would start it for pod: its environment (the config map's, then its
// own, downward API resolved) and arguments. Limits are not set here, so
// GOMEMLIMIT and GOMAXPROCS (resourceFieldRef) are left out, as Go's
// defaults. A mount Start does not provide, or an env source it does not
// know, fails: the chart cannot grow a setting the harness leaves out.
func (c *Chart) Container(pod Pod) (env map[string]string, args []string, err error) {
	spec := c.DaemonSet.Spec.Template.Spec
	var ctr *corev1.Container
	for i := range spec.Containers {
		if spec.Containers[i].Name == "install-cni" {
			ctr = &spec.Containers[i]
		}
	}
	if ctr == nil || len(ctr.Command) != 1 || ctr.Command[0] != AgentBinary {
		return nil, nil, fmt.Errorf("the DaemonSet %s runs no install-cni container", c.DaemonSet.Name)
	}
	for _, m := range ctr.VolumeMounts {
		if !provided(m.MountPath) {
			return nil, nil, fmt.Errorf("the chart mounts %s (volume %s), which the harness does not provide", m.MountPath, m.Name)
		}
	}
	env = map[string]string{}
	for _, from := range ctr.EnvFrom {
		if from.ConfigMapRef == nil || from.ConfigMapRef.Name != c.ConfigMap.Name {
			return nil, nil, fmt.Errorf("envFrom %+v not translated", from)
		}
		for k, v := range c.ConfigMap.Data {
			env[k] = v
		}
	}
	for _, e := range ctr.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			v, ok := map[string]string{"spec.nodeName": pod.NodeName, "metadata.name": pod.Name, "metadata.namespace": pod.Namespace}[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return nil, nil, fmt.Errorf("env %s: fieldRef %s not translated", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		case e.ValueFrom.ResourceFieldRef != nil:
		default:
			return nil, nil, fmt.Errorf("env %s: valueFrom not translated", e.Name)
		}
	}
	return env, ctr.Args, nil
}
