// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// TestKubelet runs kubelet on the node: it starts the agent's pod (the
// DaemonSet's template, as the DaemonSet controller would create it) with
// the chart's securityContext and probes, and a meshed pod whose HTTP
// readiness and liveness probes pass in the direct host-probe mode (a
// default-deny policy that allows only the node's address too), and in
// the SNAT mode after the agent's restart switched it, the pod running on;
// there the policy refuses them.
func TestKubelet(t *testing.T) {
	s := newScene(t)
	k := s.startKubelet()
	ctx := context.Background()

	// The agent's pod, from the chart.
	ch, err := RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), s.n.ChartValues(""))
	if err != nil {
		t.Fatal(err)
	}
	for _, obj := range ch.Objects {
		cluster.Apply(t, ReleaseNamespace, obj)
	}
	agent := s.daemonSetPod(ch)
	waitPod(t, k, agent, "agent ready (kubelet's readiness probe on /readyz)", podReady)
	hc := s.nodeHTTP()
	testenv.Eventually(t, 30*time.Second, "ztunnel connected to the agent", func() bool { return s.ztunnelConnected(hc) })

	// A meshed pod with HTTP probes.
	probe := func(path string) *corev1.Probe {
		return &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromInt32(8081)}},
			PeriodSeconds: 1, FailureThreshold: 3, TimeoutSeconds: 2}
	}
	app := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "probed", Namespace: s.ambientNS},
		Spec: corev1.PodSpec{
			NodeName:                      s.nodeName,
			TerminationGracePeriodSeconds: ptr(int64(1)),
			Containers: []corev1.Container{{
				Name: "echo", Image: EchoImage, ImagePullPolicy: corev1.PullNever,
				ReadinessProbe: probe("/ready"), LivenessProbe: probe("/live"),
				SecurityContext: &corev1.SecurityContext{RunAsUser: ptr(int64(1000))},
			}},
		},
	}
	app, err = cluster.Client.CoreV1().Pods(s.ambientNS).Create(ctx, app, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	app = waitPod(t, k, app, "meshed pod ready (its readiness probe passed)", podReady)
	if got := app.Annotations[enrollment.RedirectionAnnotation]; got != "enabled" {
		testenv.Eventually(t, 30*time.Second, "redirection annotation", func() bool {
			p, err := cluster.Client.CoreV1().Pods(app.Namespace).Get(ctx, app.Name, metav1.GetOptions{})
			return err == nil && p.Annotations[enrollment.RedirectionAnnotation] == "enabled"
		})
	}
	// Host probes in the direct mode (the chart's default): the app saw
	// both probes from the node's own address, and liveness kept passing
	// (no restart) over several periods.
	log := func() []probeLine { return probeLog(k, app) }
	var nodeAddr string
	waitProbes(t, log, 0, "readiness and liveness probes from the node's own address", func(peer string) bool {
		if nodeAddr == "" && !strings.HasPrefix(peer, ProbeV4.String()+":") {
			nodeAddr, _, _ = strings.Cut(peer, ":")
		}
		return strings.HasPrefix(peer, nodeAddr+":")
	})
	t.Logf("direct: probes from %s", nodeAddr)
	requireReady(t, app, 0)

	// A default-deny policy for the app's port that allows the node's
	// address, and not 169.254.7.127 (how a NetworkPolicy enforced at the
	// pod sees kubelet; istio/istio#49277): the probes pass on.
	netns := s.n.SandboxNetns(app.Namespace, app.Name)
	policy := []string{"INPUT", "-p", "tcp", "--dport", "8081", "!", "-s", nodeAddr, "-j", "DROP"}
	inPod := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("nsenter", append([]string{"--net=" + netns, "--", "iptables", "-w"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("iptables %v in the pod: %v: %s", args, err, out)
		}
	}
	inPod(append([]string{"-I"}, policy...)...)
	waitProbes(t, log, len(log()), "probes pass the default-deny policy from "+nodeAddr, func(peer string) bool { return strings.HasPrefix(peer, nodeAddr+":") })
	requireReady(t, app, 0)
	inPod(append([]string{"-D"}, policy...)...)

	// The SNAT mode, by an agent restart as a chart upgrade makes it: the
	// pod runs on, and its probes come from the SNAT address.
	if err := cluster.Client.CoreV1().Pods(agent.Namespace).Delete(ctx, agent.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 60*time.Second, "the agent's pod is gone", func() bool {
		_, err := cluster.Client.CoreV1().Pods(agent.Namespace).Get(ctx, agent.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	ch, err = RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), s.n.ChartValues("agent: {hostProbes: snat}\n"))
	if err != nil {
		t.Fatal(err)
	}
	agent = s.daemonSetPod(ch)
	waitPod(t, k, agent, "agent ready again, host probes in the SNAT mode", podReady)
	waitProbes(t, log, len(log()), "probes from "+ProbeV4.String()+" after the switch", func(peer string) bool {
		return strings.HasPrefix(peer, ProbeV4.String()+":")
	})
	requireReady(t, app, 0)

	// The same policy now refuses kubelet: the pod goes unready.
	inPod(append([]string{"-I"}, policy...)...)
	waitPod(t, k, app, "the SNAT mode's probes refused by the policy: the pod is not ready", func(p *corev1.Pod) bool { return !podReady(p) })
	inPod(append([]string{"-D"}, policy...)...)

	// Remove the pods through the API, as a user would; kubelet stops them.
	for _, pod := range []*corev1.Pod{app, agent} {
		if err := cluster.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Eventually(t, 30*time.Second, "kubelet removed the pods", func() bool {
		_, err1 := cluster.Client.CoreV1().Pods(app.Namespace).Get(ctx, app.Name, metav1.GetOptions{})
		_, err2 := cluster.Client.CoreV1().Pods(agent.Namespace).Get(ctx, agent.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err1) && apierrors.IsNotFound(err2)
	})
}

// daemonSetPod creates the agent's pod as the DaemonSet controller would
// (the template, bound to the node), with what the ServiceAccount admission
// plugin adds (off on the test API server): the projected token volume. The
// API server's address is the one the node reaches, as a node's
// KUBERNETES_SERVICE_* would be through kube-proxy.
func (s *scene) daemonSetPod(ch *Chart) *corev1.Pod {
	t := s.t
	ctx := context.Background()
	ca, err := cluster.ServingCert()
	if err != nil {
		t.Fatal(err)
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "kube-root-ca.crt", Namespace: ReleaseNamespace}, Data: map[string]string{"ca.crt": string(ca)}}
	if _, err := cluster.Client.CoreV1().ConfigMaps(ReleaseNamespace).Create(ctx, cm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	tmpl := ch.DaemonSet.Spec.Template.DeepCopy()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: ch.DaemonSet.Name + "-" + s.n.ID, Namespace: ReleaseNamespace, Labels: tmpl.Labels, Annotations: tmpl.Annotations},
		Spec:       tmpl.Spec,
	}
	pod.Spec.NodeName = s.nodeName
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "kube-api-access", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{
		Sources: []corev1.VolumeProjection{
			{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Path: "token", ExpirationSeconds: ptr(int64(3607))}},
			{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-root-ca.crt"}, Items: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}},
			{DownwardAPI: &corev1.DownwardAPIProjection{Items: []corev1.DownwardAPIVolumeFile{{Path: "namespace", FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}}}},
		},
	}}})
	c := &pod.Spec.Containers[0]
	c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "kube-api-access", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true})
	c.Env = append(c.Env, corev1.EnvVar{Name: "KUBERNETES_SERVICE_HOST", Value: s.api.Addr().String()},
		corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: fmt.Sprint(s.api.Port())})
	got, err := cluster.Client.CoreV1().Pods(ReleaseNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create the agent's pod: %v", err)
	}
	return got
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// waitPod waits up to 90 s for cond on the pod, failing with kubelet's and
// the pod's state.
func waitPod(t *testing.T, k *Kubelet, pod *corev1.Pod, what string, cond func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	held := false
	testenv.Poll(90*time.Second, func() bool {
		var err error
		p, err = cluster.Client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
		held = err == nil && cond(p)
		return held || k.Exited()
	})
	if !held {
		b, _ := json.MarshalIndent(p.Status, "", "  ")
		t.Fatalf("timed out waiting: %s; pod status %s\nkubelet log ends:\n%s", what, b, k.LogTail())
	}
	return p
}

// probeLine is one request the echo app logged: a kubelet probe.
type probeLine struct{ Path, Peer string }

func probeLog(k *Kubelet, app *corev1.Pod) []probeLine {
	var out []probeLine
	for _, l := range k.PodLog(app.Namespace, app.Name, string(app.UID), "echo") {
		var p probeLine
		if json.Unmarshal([]byte(l), &p) == nil && p.Path != "" {
			out = append(out, p)
		}
	}
	return out
}

// waitProbes waits until, after the first skip lines of the log, the last
// three readiness and three liveness probes came from a peer ok accepts.
func waitProbes(t *testing.T, log func() []probeLine, skip int, what string, ok func(peer string) bool) {
	t.Helper()
	var last []probeLine
	testenv.Eventually(t, 60*time.Second, what, func() bool {
		lines := log()
		last = lines[min(skip, len(lines)):]
		for _, path := range []string{"/ready", "/live"} {
			n := 0
			for i := len(last) - 1; i >= 0 && n < 3; i-- {
				if last[i].Path != path {
					continue
				}
				if !ok(last[i].Peer) {
					return false
				}
				n++
			}
			if n < 3 {
				return false
			}
		}
		return true
	})
	t.Logf("%s: %d probes, the last %+v", what, len(last), last[len(last)-1])
}

// requireReady fails unless the pod's one container is ready and has
// restarted restarts times.
func requireReady(t *testing.T, app *corev1.Pod, restarts int32) {
	t.Helper()
	p, err := cluster.Client.CoreV1().Pods(app.Namespace).Get(context.Background(), app.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cs := p.Status.ContainerStatuses; len(cs) != 1 || cs[0].RestartCount != restarts || !cs[0].Ready {
		t.Fatalf("meshed pod's container: %+v", cs)
	}
}
