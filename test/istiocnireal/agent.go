// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// Options is how a run differs from the chart's defaults.
type Options struct {
	Cluster  *kubeapi.Cluster // required: the API server it watches
	NodeName string           // required: spec.nodeName of its pod
	// PodName is its own pod's (POD_NAME; POD_NAMESPACE is the
	// release's, ReleaseNamespace); empty: istio-cni-node-<node>.
	PodName string
	// Values are the chart's values (YAML) over its values.yaml; empty:
	// AmbientProfile, as Istio's docs install it.
	Values string
	// Env overrides or adds to the environment the chart gives the
	// container (its ConfigMap and its env).
	Env map[string]string
	// PIDNamespace is the node's PID namespace, as the PID (the test's
	// numbering) of its init (Node.PIDNamespace): the agent runs in it and
	// its /host/proc lists it, so it finds the netns of pods whose pause
	// processes run there, as after a restart. 0: a namespace of the
	// agent's own, where it sees no pod's process.
	PIDNamespace int
}

// Agent is a running install-cni on a simulated node.
type Agent struct {
	t       testing.TB
	Node    *simnode.Node
	Runtime *Runtime
	Dir     string
	// RunDir is --cni-agent-run-dir (/var/run/istio-cni: the plugin's
	// event socket and kubeconfig), ZDS --ztunnel-uds-address.
	RunDir, ZDS string
	// API is the API server's address as the node reaches it (127.0.0.1 of
	// the node netns, relayed to the test's): KUBERNETES_SERVICE_*.
	API     netip.AddrPort
	Argv    []string
	Process *simnode.Process
	Started time.Time
	http    *http.Client
	opts    Options
	chart   *Chart
	cgroup  string
}

// enterScript builds the container's file system view in a new mount
// namespace and runs the agent in it, in a PID namespace whose init is in
// the node netns: the node's (Options.PIDNamespace, entered by nsenter),
// or one of the agent's own (unshare), where the shell stays as PID 1.
// /host/proc/1/ns/net is then the node netns (the machine's PID 1 is not
// even readable here). The agent itself must not be PID 1: its threads
// enter pod netns, and /proc/1/ns/net follows its main thread, so its
// "host" netns would at times be a pod's (seen: its ipset add failing
// with ENOENT). The view: a tmpfs root holding the machine's /usr, /etc,
// /dev, /sys, /tmp and /var (and the merged-/usr links), a /proc of the
// PID namespace, a /run of its own with the service account's token and
// CA, the image's /opt/cni/bin (istio-cni alone) and the binaries at
// /opt/istio, and the DaemonSet's host mounts: /host/opt/cni/bin,
// /host/etc/cni/net.d and /host/proc (the PID namespace's, again), and
// the runtime's netns folder at /host<folder>. The mount namespace goes
// with the processes; nothing here outlives them.
const enterScript = `set -eu
root=$1 bins=$2 cnibin=$3 netd=$4 netnsdir=$5 sa=$6
shift 6
mount -t tmpfs -o mode=0755 aer2-root "$root"
for d in bin sbin lib lib32 lib64 libx32 usr etc dev sys tmp var; do
	if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$root/$d"
	elif [ -d "/$d" ]; then mkdir "$root/$d"; mount --rbind "/$d" "$root/$d"; fi
done
mkdir "$root/proc"
mount -t proc aer2-proc "$root/proc"
mkdir "$root/run"
mount -t tmpfs -o mode=0755 aer2-run "$root/run"
mkdir -p "$root/run/secrets/kubernetes.io/serviceaccount" "$root/opt/cni/bin" "$root/opt/istio" \
	"$root/host/opt/cni/bin" "$root/host/etc/cni/net.d" "$root/host/proc" "$root/host$netnsdir"
mount --bind -o ro "$sa" "$root/run/secrets/kubernetes.io/serviceaccount"
mount --bind -o ro "$bins" "$root/opt/istio"
touch "$root/opt/cni/bin/istio-cni"
mount --bind -o ro "$bins/istio-cni" "$root/opt/cni/bin/istio-cni"
mount --bind "$cnibin" "$root/host/opt/cni/bin"
mount --bind "$netd" "$root/host/etc/cni/net.d"
mount -t proc aer2-hostproc "$root/host/proc"
mount --bind "$netnsdir" "$root/host$netnsdir"
chroot "$root" /usr/bin/env -i "$@" &
wait $!
`

// Start runs install-cni as istio-cni's DaemonSet runs it in ambient mode
// on the runtime's node: in the node netns (its pod shares it: the chart's
// ambient.shareHostNetworkNamespace; otherwise its health and metrics
// would be in a pod netns of their own), in a mount namespace of its own
// (enterScript), with the environment and arguments of the chart rendered
// with o.Values (Chart.Container), in-cluster credentials of the API
// server for the chart's service account (so its cluster roles apply),
// the runtime's CNI folders as the host's, and its sockets in a folder of
// t's. It does not wait; WaitReady does. It is
// stopped by PID at t's cleanup, which also removes what it left.
func Start(t testing.TB, r *Runtime, bins Bins, o Options) *Agent {
	t.Helper()
	node := r.Node
	dir := t.TempDir()
	a := &Agent{t: t, Node: node, Runtime: r, Dir: dir, RunDir: filepath.Join(dir, "istio-cni"), ZDS: filepath.Join(dir, "ztunnel", "ztunnel.sock")}
	sa := filepath.Join(dir, "serviceaccount")
	root := filepath.Join(dir, "root")
	for _, d := range []string{a.RunDir, filepath.Dir(a.ZDS), sa, root} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if o.PodName == "" {
		o.PodName = "istio-cni-node-" + o.NodeName
	}
	if o.Values == "" {
		o.Values = AmbientProfile
	}
	ch, err := RenderChart(o.Values)
	if err != nil {
		t.Fatalf("istio-cni's chart: %v", err)
	}
	// The chart's service account and cluster roles (not its DaemonSet:
	// without it, a stopped agent uninstalls), and a token of that
	// account where kubelet projects it, with the API server's CA.
	o.Cluster.EnsureNamespace(t, ReleaseNamespace)
	for _, obj := range ch.Objects {
		switch obj.(type) {
		case *corev1.ServiceAccount, *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding:
			o.Cluster.Apply(t, ReleaseNamespace, obj)
		}
	}
	token := o.Cluster.ServiceAccountToken(t, ReleaseNamespace, ch.DaemonSet.Spec.Template.Spec.ServiceAccountName)
	ca, err := o.Cluster.ServingCert()
	if err != nil {
		t.Fatalf("api server's certificate: %v", err)
	}
	for name, content := range map[string]string{"token": token, "ca.crt": string(ca), "namespace": ReleaseNamespace} {
		if err := os.WriteFile(filepath.Join(sa, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}

	a.API = r.NodeAPI(o.Cluster)

	env, args, err := ch.Container(Pod{NodeName: o.NodeName, Name: o.PodName, Namespace: ReleaseNamespace})
	if err != nil {
		t.Fatalf("istio-cni's chart: %v", err)
	}
	// What kubelet and the image add: the service's address (as the
	// node reaches it) and the image's PATH.
	maps.Copy(env, map[string]string{
		"KUBERNETES_SERVICE_HOST": a.API.Addr().String(), "KUBERNETES_SERVICE_PORT": fmt.Sprint(a.API.Port()),
		"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	})
	maps.Copy(env, o.Env)
	a.Argv = []string{"unshare", "--mount", "--propagation", "slave", "--pid", "--fork", "--kill-child=SIGKILL", "--"}
	if o.PIDNamespace != 0 {
		a.Argv = []string{"nsenter", "--target", strconv.Itoa(o.PIDNamespace), "--pid", "--", "unshare", "--mount", "--propagation", "slave", "--"}
	}
	a.Argv = append(a.Argv, "/bin/sh", "-c", enterScript, "enter", root, bins.Dir, r.BinDir, r.ConfDir, r.NetnsDir, sa)
	for _, k := range slices.Sorted(maps.Keys(env)) {
		a.Argv = append(a.Argv, k+"="+env[k])
	}
	a.Argv = append(a.Argv, "/opt/istio/"+AgentBinary)
	a.Argv = append(append(a.Argv, args...), "--cni-agent-run-dir", a.RunDir, "--ztunnel-uds-address", a.ZDS)

	c, closeHTTP, err := simnode.HTTPClient(node.NodeNS)
	if err != nil {
		t.Fatalf("http client in netns %s: %v", node.NodeNS, err)
	}
	t.Cleanup(closeHTTP)
	a.http = c
	a.opts, a.chart = o, ch
	a.cgroup = filepath.Join(node.CgroupRoot, "istio-cni")
	if err := os.Mkdir(a.cgroup, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	a.launch()
	return a
}

// launch execs the agent (Argv) in its cgroup.
func (a *Agent) launch() {
	a.Started = time.Now()
	a.Process = simnode.StartProcess(a.t, a.Node.NodeNS, a.cgroup, a.Argv...)
	// Before StartProcess's cleanup (which would end unshare, and with it
	// the agent, by SIGKILL; or nsenter, leaving it): the agent's own
	// shutdown first.
	a.t.Cleanup(func() {
		if !a.Process.Exited() {
			if err := a.Stop(30 * time.Second); err != nil {
				a.t.Errorf("%v", err)
			}
		}
	})
}

// Launch execs install-cni again after Stop, as its DaemonSet schedules
// it back on the node, with the same folders and sockets; WaitReady waits
// for it.
func (a *Agent) Launch() {
	if !a.Process.Exited() {
		a.t.Fatalf("install-cni is still running (pid %d)", a.PID())
	}
	a.launch()
}

// LeaveNode stops install-cni as a node-by-node move away from it does
// (the README's takeover runbook): its DaemonSet (the chart's) in the API
// server with a node affinity that excludes nodes labelled label=value,
// and its Node so labelled. It then shuts down as on an uninstall of the
// node (its plugin and node rules go, the pods' rules stay), and says so;
// an error if it decided otherwise. The DaemonSet and the label stay, as
// in the cluster, until ReturnToNode.
func (a *Agent) LeaveNode(label, value string) error {
	ctx := context.Background()
	c := a.opts.Cluster
	ds := a.chart.DaemonSet.DeepCopy()
	ds.Spec.Template.Spec.Affinity = &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
		RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{{
			MatchExpressions: []corev1.NodeSelectorRequirement{{Key: label, Operator: corev1.NodeSelectorOpNotIn, Values: []string{value}}}}}}}}
	c.Apply(a.t, ReleaseNamespace, ds)
	if err := a.labelNode(ctx, label, &value); err != nil {
		return err
	}
	if err := a.Stop(30 * time.Second); err != nil {
		return fmt.Errorf("install-cni leaving node %s: %w", a.opts.NodeName, err)
	}
	if out := a.Process.Output.String(); !strings.Contains(out, "due to NodeAffinity rules") {
		return fmt.Errorf("install-cni did not leave node %s for its DaemonSet's node affinity:\n%s", a.opts.NodeName, out)
	}
	return nil
}

// ReturnToNode takes the label LeaveNode set off the Node and execs
// install-cni again, as its DaemonSet schedules it back; once it is
// ready the DaemonSet goes again, so that a later stop uninstalls as
// before.
func (a *Agent) ReturnToNode(label string) error {
	ctx := context.Background()
	if err := a.labelNode(ctx, label, nil); err != nil {
		return err
	}
	a.Launch()
	_, err := a.WaitReady()
	if derr := a.opts.Cluster.Client.AppsV1().DaemonSets(ReleaseNamespace).Delete(ctx, a.chart.DaemonSet.Name, metav1.DeleteOptions{}); derr != nil {
		err = errors.Join(err, fmt.Errorf("delete daemonset %s/%s: %w", ReleaseNamespace, a.chart.DaemonSet.Name, derr))
	}
	return err
}

// labelNode sets (value non-nil) or removes the label on the agent's
// Node, creating the Node when it is missing.
func (a *Agent) labelNode(ctx context.Context, label string, value *string) error {
	nodes := a.opts.Cluster.Client.CoreV1().Nodes()
	n, err := nodes.Get(ctx, a.opts.NodeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		n, err = nodes.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: a.opts.NodeName}}, metav1.CreateOptions{})
	}
	if err != nil {
		return fmt.Errorf("node %s: %w", a.opts.NodeName, err)
	}
	if n.Labels == nil {
		n.Labels = map[string]string{}
	}
	if value != nil {
		n.Labels[label] = *value
	} else {
		delete(n.Labels, label)
	}
	if _, err := nodes.Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("label node %s: %w", a.opts.NodeName, err)
	}
	return nil
}

// Restart stops install-cni as a rolling update stops it, with its
// DaemonSet (the chart's) and its Node present in the API server, so it
// leaves the node's plugin and pods in place, and execs it again with the
// same folders and sockets (its ZDS peer reconnects). The DaemonSet goes
// again once it stopped, so that a later stop uninstalls as before. It
// does not wait for the new one (WaitReady does).
func (a *Agent) Restart() error {
	if err := a.StopForUpdate(); err != nil {
		return fmt.Errorf("restart install-cni: %w", err)
	}
	a.launch()
	return nil
}

// StopForUpdate stops install-cni as a rolling update stops it (Restart
// without the exec): its plugin stays chained, its node state stays, and
// the node has no agent until Launch.
func (a *Agent) StopForUpdate() error {
	ctx := context.Background()
	c := a.opts.Cluster
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: a.opts.NodeName}}, metav1.CreateOptions{}); err != nil &&
		!apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create node %s: %w", a.opts.NodeName, err)
	}
	c.Apply(a.t, ReleaseNamespace, a.chart.DaemonSet.DeepCopy())
	err := a.Stop(30 * time.Second)
	if derr := c.Client.AppsV1().DaemonSets(ReleaseNamespace).Delete(ctx, a.chart.DaemonSet.Name, metav1.DeleteOptions{}); derr != nil {
		err = errors.Join(err, fmt.Errorf("delete daemonset %s/%s: %w", ReleaseNamespace, a.chart.DaemonSet.Name, derr))
	}
	return err
}

// PID is install-cni's process id as the test sees it (under unshare,
// the init shell of its PID namespace, then it), or 0 when it is not
// running.
func (a *Agent) PID() int {
	pid := a.Process.PID()
	for range 2 {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		if err != nil {
			return 0
		}
		if pid, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
			return 0
		}
	}
	return pid
}

// Get fetches a path from the agent's readiness server (:8000), or its
// metrics server (:15014) for /metrics, in the node netns; on an error the
// code is 0 and the body the error.
func (a *Agent) Get(path string) (int, string) {
	port := "8000"
	if path == "/metrics" {
		port = "15014"
	}
	code, body, err := simnode.Get(a.http, "http://127.0.0.1:"+port+path)
	if err != nil {
		return 0, err.Error()
	}
	return code, body
}

// WaitReady waits until /readyz answers 200 (the plugin installed, the
// node agent serving) and returns the time since its exec; it fails when
// the agent exits first or takes more than two minutes.
func (a *Agent) WaitReady() (time.Duration, error) {
	var code int
	var took time.Duration
	testenv.Poll(2*time.Minute, func() bool {
		code, _ = a.Get("/readyz")
		took = time.Since(a.Started)
		return code == http.StatusOK || a.Process.Exited()
	})
	if code != http.StatusOK {
		return 0, fmt.Errorf("install-cni not ready (/readyz %d); its output:\n%s", code, a.Process.Output.String())
	}
	return took, nil
}

// WaitZtunnel waits until a ztunnel (started by the caller) is connected,
// as its metric ztunnel_connected says.
func (a *Agent) WaitZtunnel() error {
	var body string
	if !testenv.Poll(time.Minute, func() bool {
		_, body = a.Get("/metrics")
		return strings.Contains(body, "\nistio_cni_ztunnel_connected 1\n") || strings.Contains(body, "\nztunnel_connected 1\n")
	}) {
		return fmt.Errorf("ztunnel not connected to install-cni after 1m; its output:\n%s", a.Process.Output.String())
	}
	return nil
}

// Stop sends install-cni SIGTERM by its PID (as kubelet stops its
// container), kills it after grace, and says why when it did not exit
// cleanly on its own.
func (a *Agent) Stop(grace time.Duration) error {
	pid := a.PID()
	if pid > 0 {
		if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
			return fmt.Errorf("signal install-cni (pid %d): %w", pid, err)
		}
	}
	// unshare or nsenter exits with it; unshare blocks SIGTERM itself,
	// so Terminate's SIGTERM only matters after the wait, when it kills.
	// nsenter forwards no signal: the agent is killed by its PID first.
	if !testenv.Poll(grace, a.Process.Exited) || !a.Process.Terminate(time.Second) {
		if pid > 0 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		a.Process.Kill()
		return fmt.Errorf("install-cni did not stop cleanly; its output:\n%s", a.Process.Output.String())
	}
	return nil
}
