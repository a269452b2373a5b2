// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
)

// TestReboot reboots a node without drain, as the failures istio-cni's
// users report most happen (issue 33; istio/istio#55968, #56652, #55913,
// #60882): kubelet, containerd, the agent's pod and ztunnel are killed at
// once, and what a reboot removes goes (pods' netns and sandboxes, the
// bpffs, /run, the pods' cgroups); kubelet restarts every pod as soon as
// the runtime is up. Throughout, a sampler dials every pod from another
// pod and from the node every 100 ms: an answer from an ambient pod's app
// that did not pass ztunnel fails the test, as does one from a pod outside
// the mesh that did.
//
// The agent installs the chart's default owned conflist (it stays on disk
// and the runtime selects it before the primary's), and its plugin fails
// closed for ambient pods while the agent is unreachable: kubelet retries
// their sandboxes until the agent answers.
func TestReboot(t *testing.T) {
	s := newScene(t)
	k := s.startKubelet()
	ch, err := RenderChart(filepath.Join(repoRoot, "deploy", "ambient-ebpf"), s.n.OwnedChartValues(""))
	if err != nil {
		t.Fatal(err)
	}
	for _, obj := range ch.Objects {
		cluster.Apply(t, ReleaseNamespace, obj)
	}
	agent := s.daemonSetPod(ch)
	waitPod(t, k, agent, "agent ready", podReady)
	s.waitAgent(k, time.Now())

	ambient := map[string]bool{"a1": true, "a2": true}
	a1, a2 := s.kubeletEcho(s.ambientNS, "a1"), s.kubeletEcho(s.ambientNS, "a2")
	p1 := s.kubeletEcho(s.plainNS, "p1")
	pods := []*corev1.Pod{a1, a2, p1}
	for _, p := range pods {
		waitPod(t, k, p, p.Name+" ready", podReady)
	}
	sp := s.startSampler(p1, pods...)
	start := time.Now()
	s.waitServed(sp, k, start, ambient, pods)
	judged := start

	// check fails the step on any bypass or capture since its last call.
	check := func(t *testing.T, what string) {
		t.Helper()
		now := time.Now()
		if s.zt.proc.Exited() {
			t.Fatalf("%s: the ztunnel stand-in exited:\n%s", what, s.zt.proc.Output.String())
		}
		v := judge(sp.since(judged), s.zt.all(), ambient)
		judged = now
		t.Logf("%s: %s", what, v)
		if len(v.Bypass)+len(v.Captured) > 0 {
			t.Errorf("%s: %s", what, v)
		}
	}
	check(t, "before the reboots")

	s.run("reboot, the agent 30 s late, the primary CNI rewrites its conflist first", func(t *testing.T) {
		// The agent's image is not on the node at boot (a new version, or
		// garbage-collected): it arrives 30 s after kubelet starts.
		out, err := exec.Command("ctr", "--address", s.n.Socket, "--namespace", "k8s.io", "images", "rm", ProjectImage).CombinedOutput()
		if err != nil {
			t.Fatalf("ctr images rm %s: %v: %s", ProjectImage, err, out)
		}
		boot := s.reboot(k, nil, s.rewritePrimaryConflist)
		time.Sleep(30 * time.Second)
		waiting := s.sandboxFailures(boot, a1, a2)
		s.n.ImportImage(images.Project)
		ready := s.waitAgent(k, boot)
		s.report(t, sp, k, boot, ready, ambient, pods, waiting)
		check(t, "reboot with the agent late")
	})

	s.run("reboot mid-write, the agent first, the primary CNI rewrites its conflist after it", func(t *testing.T) {
		// The worst a cut write can leave (the installer renames a synced
		// temp file, so only a file system that loses the rename's order
		// could): the owned conflist cut in half.
		owned := filepath.Join(s.n.CNIConf, OwnedConflist)
		boot := s.reboot(k, func() {
			b, err := os.ReadFile(owned)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(owned, b[:len(b)/2], 0o644); err != nil {
				t.Fatal(err)
			}
		}, nil)
		ready := s.waitAgent(k, boot)
		s.rewritePrimaryConflist()
		s.report(t, sp, k, boot, ready, ambient, pods, nil)
		check(t, "reboot with the agent first")
	})

	s.run("containerd restart", func(t *testing.T) {
		before := s.nodeState(pods)
		s.n.containerd.Kill()
		time.Sleep(5 * time.Second)
		s.n.StartContainerd()
		time.Sleep(10 * time.Second) // kubelet's relist, the sampler on
		s.waitServed(sp, k, time.Now(), ambient, pods)
		s.requireSameState(t, before, s.nodeState(pods))
		check(t, "containerd restart")
	})

	s.run("agent crash loop", func(t *testing.T) {
		before := s.nodeState(pods)
		end := time.Now().Add(60 * time.Second)
		kills := 0
		for time.Now().Before(end) {
			if pid := s.agentPID(agent); pid > 0 {
				if syscall.Kill(pid, syscall.SIGKILL) == nil {
					kills++
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
		p, err := cluster.Client.CoreV1().Pods(agent.Namespace).Get(context.Background(), agent.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("the agent killed %d times in 60 s; kubelet restarted it %d times (CrashLoopBackOff)", kills, p.Status.ContainerStatuses[0].RestartCount)
		back := time.Now()
		ready := s.waitAgent(k, back)
		t.Logf("the agent ready %.1f s after the crash loop ended", ready.Sub(back).Seconds())
		s.waitServed(sp, k, time.Now(), ambient, pods)
		s.requireSameState(t, before, s.nodeState(pods))
		check(t, "agent crash loop")
	})

	s.run("uninstall, then a reboot", func(t *testing.T) {
		sp.Stop() // without the agent, the pods leave the mesh by design
		ctx := context.Background()
		if err := cluster.Client.AppsV1().DaemonSets(ReleaseNamespace).Delete(ctx, ch.DaemonSet.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := cluster.Client.CoreV1().Pods(agent.Namespace).Delete(ctx, agent.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		testenv.Eventually(t, 90*time.Second, "the agent's pod is gone", func() bool {
			_, err := cluster.Client.CoreV1().Pods(agent.Namespace).Get(ctx, agent.Name, metav1.GetOptions{})
			return apierrors.IsNotFound(err)
		})
		for _, f := range []string{filepath.Join(s.n.CNIConf, OwnedConflist), filepath.Join(s.n.CNIBin, "ambient-ebpf-cni")} {
			if _, err := os.Stat(f); !os.IsNotExist(err) {
				t.Errorf("uninstalled, and %s is still there (%v)", f, err)
			}
		}
		boot := s.reboot(k, nil, nil)
		late := s.kubeletEcho(s.ambientNS, "late")
		for _, p := range append(pods, late) {
			p := waitPod(t, k, p, p.Name+" running again after the reboot, without the agent", func(p *corev1.Pod) bool {
				return podReady(p) && startedSince(p, boot)
			})
			t.Logf("%s ready %.1f s after kubelet started, at %s", p.Name, time.Since(boot).Seconds(), p.Status.PodIP)
		}
	})
}

// startKubelet runs kubelet on the scene's node and waits until it
// registered the node and reports it ready.
func (s *scene) startKubelet() *Kubelet {
	t := s.t
	t.Helper()
	bins, err := kubeapi.FindBinaries()
	if err != nil {
		testenv.SkipOrFail(t, "%v", err)
	}
	kubelet := filepath.Join(bins, "kubelet")
	if _, err := os.Stat(kubelet); err != nil {
		testenv.SkipOrFail(t, "kubelet not built (make kube-bins): %v", err)
	}
	k := s.n.StartKubelet(kubelet, s.nodeName, s.api, cluster.Config.BearerToken)
	testenv.Eventually(t, 30*time.Second, "kubelet registers the node and is ready", func() bool {
		if k.Exited() {
			t.Fatalf("kubelet exited:\n%s", k.LogTail())
		}
		n, err := cluster.Client.CoreV1().Nodes().Get(context.Background(), s.nodeName, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
				return true
			}
		}
		return false
	})
	// ztunnel runs as a pod where kubelet runs: the agent's socket
	// programs attach to kubepods and see its sockets there.
	s.zt.proc.Terminate(5 * time.Second)
	s.ztCgroup = filepath.Join(s.n.Cgroup2, "kubepods", "ztunnel")
	s.startZtunnel()
	return k
}

// kubeletEcho creates a pod kubelet runs: the echo server, answering with
// the pod's name.
func (s *scene) kubeletEcho(ns, name string) *corev1.Pod {
	t := s.t
	t.Helper()
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			NodeName:                      s.nodeName,
			TerminationGracePeriodSeconds: ptr(int64(1)),
			Containers: []corev1.Container{{
				Name: "echo", Image: EchoImage, ImagePullPolicy: corev1.PullNever,
				Command:         []string{AppBinary, "serve", name, ":8080", ":8081"},
				SecurityContext: &corev1.SecurityContext{RunAsUser: ptr(int64(1000))},
			}},
		},
	}
	p, err := cluster.Client.CoreV1().Pods(ns).Create(context.Background(), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// reboot powers the node off, runs off (what the cut left on disk, if
// anything), wipes what a reboot wipes and boots it: containerd, then
// beforeKubelet (the primary CNI's start, say), then kubelet and ztunnel.
// It returns when kubelet started.
func (s *scene) reboot(k *Kubelet, off, beforeKubelet func()) time.Time {
	s.t.Helper()
	s.n.PowerOff()
	if off != nil {
		off()
	}
	s.n.WipeVolatile()
	s.n.StartContainerd()
	if beforeKubelet != nil {
		beforeKubelet()
	}
	boot := time.Now()
	k.Start()
	s.startZtunnel()
	return boot
}

// rewritePrimaryConflist writes the primary CNI's conflist again, as
// Cilium, Calico and flannel's installer do at their start: their own
// plugins only.
func (s *scene) rewritePrimaryConflist() {
	s.t.Helper()
	conf := fmt.Sprintf(primaryCNI, PodSubnet, filepath.Join(s.n.Dir, "ipam"))
	if err := os.WriteFile(filepath.Join(s.n.CNIConf, "10-ptp.conflist"), []byte(conf), 0o644); err != nil {
		s.t.Fatal(err)
	}
}

// waitAgent waits until the agent answers /readyz with ztunnel connected,
// and returns when it first did.
func (s *scene) waitAgent(k *Kubelet, since time.Time) time.Time {
	s.t.Helper()
	hc := s.nodeHTTP()
	var at time.Time
	ok := testenv.PollEvery(100*time.Millisecond, 3*time.Minute, func() bool {
		resp, err := hc.Get("http://127.0.0.1:8000/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		if resp.StatusCode == 200 && s.ztunnelConnected(hc) {
			at = time.Now()
			return true
		}
		return false
	})
	if !ok {
		s.t.Fatalf("the agent not ready %s after %s\nkubelet log ends:\n%s", time.Since(since).Round(time.Second), since.Format(time.TimeOnly), k.LogTail())
	}
	return at
}

// waitServed waits until every pod answered a sample taken after since:
// an ambient pod through ztunnel, another directly. It returns when each
// first did.
func (s *scene) waitServed(sp *sampler, k *Kubelet, since time.Time, ambient map[string]bool, pods []*corev1.Pod) map[string]time.Time {
	s.t.Helper()
	first := map[string]time.Time{}
	ok := testenv.PollEvery(200*time.Millisecond, 3*time.Minute, func() bool {
		for _, smp := range sp.since(since) {
			if smp.Server == smp.Target && smp.via() == ambient[smp.Server] {
				if _, ok := first[smp.Target]; !ok {
					first[smp.Target] = smp.At
				}
			}
		}
		return len(first) == len(pods)
	})
	if !ok {
		var missing []string
		for _, p := range pods {
			if _, ok := first[p.Name]; !ok {
				missing = append(missing, p.Name)
			}
		}
		if s.zt.proc.Exited() {
			s.t.Fatalf("the ztunnel stand-in exited:\n%s", s.zt.proc.Output.String())
		}
		last := sp.since(time.Now().Add(-2 * time.Second))
		s.t.Fatalf("not served as their mesh state says, 3 min after %s: %v; the last samples %+v\nkubelet log ends:\n%s",
			since.Format(time.TimeOnly), missing, last, k.LogTail())
	}
	return first
}

// sandboxFailures counts, for each pod, the sandboxes kubelet could not
// create since t (its FailedCreatePodSandBox events).
func (s *scene) sandboxFailures(t time.Time, pods ...*corev1.Pod) map[string]int32 {
	out := map[string]int32{}
	for _, p := range pods {
		evs, err := cluster.Client.CoreV1().Events(p.Namespace).List(context.Background(), metav1.ListOptions{
			FieldSelector: "involvedObject.name=" + p.Name + ",reason=FailedCreatePodSandBox"})
		if err != nil {
			s.t.Fatal(err)
		}
		for _, e := range evs.Items {
			if !e.LastTimestamp.Time.Before(t.Truncate(time.Second)) {
				out[p.Name] += max(e.Count, 1)
			}
		}
	}
	return out
}

// report waits until every pod is served as its mesh state says and
// logs the boot's figures: when the agent was ready, when each pod was
// served, and how many sandboxes kubelet retried for it. It fails unless
// every ambient pod ends annotated enabled.
func (s *scene) report(t *testing.T, sp *sampler, k *Kubelet, boot, agentReady time.Time, ambient map[string]bool, pods []*corev1.Pod, waitedBefore map[string]int32) {
	t.Helper()
	served := s.waitServed(sp, k, boot, ambient, pods)
	var names []string
	for _, p := range pods {
		names = append(names, p.Name)
	}
	failures := s.sandboxFailures(boot, pods...)
	t.Logf("kubelet started at 0 s; the agent ready at %.1f s", agentReady.Sub(boot).Seconds())
	var last time.Time
	for _, name := range names {
		at := served[name]
		mode := "directly (outside the mesh)"
		if ambient[name] {
			mode = "through ztunnel"
			last = maxTime(last, at)
		}
		extra := ""
		if n, ok := waitedBefore[name]; ok {
			extra = fmt.Sprintf(", %d of them before the agent's image arrived", n)
		}
		t.Logf("  %s: served %s at %.1f s; kubelet's sandbox attempts that failed: %d%s", name, mode, at.Sub(boot).Seconds(), failures[name], extra)
	}
	t.Logf("the last ambient pod enrolled %.1f s after the agent was ready", last.Sub(agentReady).Seconds())
	for _, p := range pods {
		if !ambient[p.Name] {
			continue
		}
		testenv.Eventually(t, 30*time.Second, p.Name+" annotated enabled", func() bool {
			got, err := cluster.Client.CoreV1().Pods(p.Namespace).Get(context.Background(), p.Name, metav1.GetOptions{})
			return err == nil && got.Annotations[enrollment.RedirectionAnnotation] == "enabled"
		})
	}
	owned, err := os.ReadFile(filepath.Join(s.n.CNIConf, OwnedConflist))
	if err != nil || !strings.Contains(string(owned), `"ambient-ebpf-cni"`) {
		t.Errorf("the owned conflist after the boot: %v\n%s", err, owned)
	}
}

// startedSince reports whether the pod's containers all started at or
// after t (the API's times are in whole seconds).
func startedSince(p *corev1.Pod, t time.Time) bool {
	for _, c := range p.Status.ContainerStatuses {
		if c.State.Running == nil || c.State.Running.StartedAt.Time.Before(t.Truncate(time.Second)) {
			return false
		}
	}
	return len(p.Status.ContainerStatuses) > 0
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// podState is what a restart must leave alone: the sandbox, the app's
// restarts, and whether ztunnel was handed the pod again.
type podState struct {
	Sandbox  string
	Restarts int32
}

type nodeState struct {
	Pods  map[string]podState
	Added int // "pod added" lines of the ztunnel stand-in
}

func (s *scene) nodeState(pods []*corev1.Pod) nodeState {
	s.t.Helper()
	st := nodeState{Pods: map[string]podState{}, Added: strings.Count(s.zt.proc.Output.String(), "pod added")}
	ctx, cancel := s.n.ctx()
	defer cancel()
	for _, p := range pods {
		got, err := cluster.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			s.t.Fatal(err)
		}
		list, err := s.n.Runtime.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{Filter: &cri.PodSandboxFilter{
			State:         &cri.PodSandboxStateValue{State: cri.PodSandboxState_SANDBOX_READY},
			LabelSelector: map[string]string{"io.kubernetes.pod.uid": string(got.UID)},
		}})
		if err != nil {
			s.t.Fatal(err)
		}
		var ids []string
		for _, sb := range list.Items {
			ids = append(ids, sb.Id[:12])
		}
		var restarts int32
		for _, c := range got.Status.ContainerStatuses {
			restarts += c.RestartCount
		}
		st.Pods[p.Name] = podState{Sandbox: strings.Join(ids, ","), Restarts: restarts}
	}
	return st
}

// requireSameState fails unless no pod got a new sandbox or restarted and
// ztunnel was handed no pod again: nothing was re-enrolled.
func (s *scene) requireSameState(t *testing.T, before, after nodeState) {
	t.Helper()
	b, _ := json.Marshal(before)
	a, _ := json.Marshal(after)
	if string(a) != string(b) {
		t.Errorf("a restart re-enrolled or restarted pods:\nbefore %s\nafter  %s", b, a)
		return
	}
	t.Logf("no pod re-enrolled or restarted: %s", a)
}

// agentPID is the PID of the agent container's process, or 0 while none
// runs (kubelet's back-off).
func (s *scene) agentPID(agent *corev1.Pod) int {
	ctx, cancel := s.n.ctx()
	defer cancel()
	list, err := s.n.Runtime.ListContainers(ctx, &cri.ListContainersRequest{Filter: &cri.ContainerFilter{
		State:         &cri.ContainerStateValue{State: cri.ContainerState_CONTAINER_RUNNING},
		LabelSelector: map[string]string{"io.kubernetes.pod.uid": string(agent.UID)},
	}})
	if err != nil || len(list.Containers) == 0 {
		return 0
	}
	st, err := s.n.Runtime.ContainerStatus(ctx, &cri.ContainerStatusRequest{ContainerId: list.Containers[0].Id, Verbose: true})
	if err != nil {
		return 0
	}
	var info struct{ Pid int }
	if json.Unmarshal([]byte(st.Info["info"]), &info) != nil {
		return 0
	}
	return info.Pid
}
