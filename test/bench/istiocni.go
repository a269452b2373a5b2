// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench && istiocnireal

package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// istioCNI is the enrolment figures' third column: the real istio-cni
// (Istio's install-cni and its chained plugin istio-cni, test/istiocnireal)
// on a simulated node of its own, against a real kube-apiserver, with the
// same ZDS peer as ours (the acker, in a helper of that node) and a
// runtime helper in its node netns that execs its plugin as ours is
// exec'd. Its pods are light pods of that node, each also a pod of an
// ambient namespace in the API server, created before the clock runs.
type istioCNI struct {
	t         *testing.T
	cluster   *kubeapi.Cluster
	node      *istiocnireal.Node
	light     *lightPods
	runtime   *simnode.Proc
	zt        *simnode.Proc // the ZDS acker install-cni hands pods to
	conflist  []byte
	namespace string
	// sandboxes are the pods' netns as the runtime names them (CNI_NETNS,
	// in the runtime's netns folder, which install-cni sees), by UID.
	sandboxes map[string]string
	kube      map[string]*corev1.Pod // the pods' API objects, by UID
}

// startIstioCNI starts the API server and the real istio-cni's node;
// both go with t's cleanup. A missing binary fails the run (make bench
// builds them first).
func startIstioCNI(t *testing.T) *istioCNI {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	c, err := kubeapi.Start(ctx)
	cancel()
	c = kubeapi.Require(t, c, err)
	t.Cleanup(c.Stop)
	ic := &istioCNI{t: t, cluster: c, sandboxes: map[string]string{}, kube: map[string]*corev1.Pod{}}
	nodeName := "bench-istio-cni"
	ic.node = istiocnireal.StartNode(t, c, nodeName, func(n *simnode.Node, zds string) {
		ic.zt = simnode.StartHelper(t, roleZtunnel, n.NodeNS, ic.cgroup(n, "ztunnel"))
		if err := call(ic.zt, ztunnelRequest{Op: "zds", Socket: zds}, nil); err != nil {
			t.Fatalf("connect to install-cni over ZDS: %v", err)
		}
	})
	list, err := ic.node.Runtime.Conflist()
	if err != nil {
		t.Fatal(err)
	}
	ic.conflist = list.Bytes
	ic.namespace = c.Namespace(t, "bench", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}).Name
	ic.light = newLightPods(t, ic.node.Node)
	ic.light.pidns = ic.node.PIDNamespace
	ic.runtime = simnode.StartHelper(t, roleRuntime, ic.node.Node.NodeNS, ic.cgroup(ic.node.Node, "runtime"))
	return ic
}

func (ic *istioCNI) cgroup(n *simnode.Node, name string) string {
	cg := filepath.Join(n.CgroupRoot, name)
	if err := os.Mkdir(cg, 0o755); err != nil {
		ic.t.Fatal(err)
	}
	return cg
}

// batch makes count pods prefix<i>: first in the API server (bound to
// the node, in the ambient namespace), then their netns (with a pause
// process in a pod cgroup with pause) and sandbox paths, so install-cni's
// informer has them before their ADD.
func (ic *istioCNI) batch(prefix string, count int, pause bool) []*simnode.Pod {
	ic.t.Helper()
	pods := ic.light.plan(prefix, count)
	for _, p := range pods {
		kp := ic.cluster.Pod(ic.t, kubeapi.PodSpec{Namespace: ic.namespace, Name: p.Name, Node: ic.node.Name})
		p.Namespace, p.UID = kp.Namespace, string(kp.UID)
		ic.kube[p.UID] = kp
	}
	if err := ic.light.create(pods, pause); err != nil {
		ic.t.Fatalf("make pods: %v", err)
	}
	for _, p := range pods {
		ic.sandboxes[p.UID] = ic.node.Runtime.Sandbox(p)
	}
	return pods
}

// cni has its runtime helper exec istio-cni (ADD or VERSION) for pods,
// conc calls in flight; an ADD holds when the pod's in-pod chains are
// committed (checkInpod).
func (ic *istioCNI) cni(command string, pods []*simnode.Pod, conc int) (cniResult, error) {
	req := cniRequest{Command: command, Conflist: ic.conflist, Plugin: istiocnireal.PluginBinary, BinDir: ic.node.Runtime.BinDir,
		Conc: conc, Check: checkInpod, Pods: toCNIPods(pods)}
	for i := range req.Pods {
		req.Pods[i].Netns = ic.sandboxes[req.Pods[i].UID]
	}
	var res cniResult
	if err := call(ic.runtime, req, &res); err != nil {
		out := ic.node.Agent.Process.Output.String()
		return res, fmt.Errorf("%w; install-cni's latest output:\n%s", err, out[max(0, len(out)-4000):])
	}
	return res, nil
}

// version names the binaries' istio.io/istio.
func (ic *istioCNI) version() string { return istiocnireal.Module + " " + ic.node.Bins.Version }

// istioScale is what the real istio-cni's scale run measured.
type istioScale struct {
	add            cniResult
	remove         time.Duration
	addCPU, delCPU time.Duration // install-cni's user+system time
	before, at     int64         // install-cni's VmRSS, bytes: before the ADDs, with every pod in
	hwm            int64         // its VmHWM after the ADDs
	// adopt is from the exec of a restarted install-cni to /readyz 200
	// and a snapshot with every pod (its netns) at the acker; adoptCPU
	// its CPU time until then; ready the /readyz part alone.
	adopt, adoptCPU, ready time.Duration
	// addProfile and adoptProfile are install-cni's CPU profiles while
	// enrolling and adopting (perf, share of the samples).
	addProfile, adoptProfile string
	// mounts counts the mounts in install-cni's mount namespace before the
	// ADDs and with every pod in (each iptables call of its copies them).
	mountsBefore, mounts int
}

// istioFrames are the functions worth naming in install-cni's profile:
// Istio's own and the file and netlink calls they make.
var istioFrames = regexp.MustCompile(`istio\.io/istio/(cni|pkg|tools)/|vishvananda/netlink\.|^os\.(ReadFile|Open|ReadDir)|^io/fs\.|^regexp\.|^runtime\.(gcBgMarkWorker|mallocgc)$`)

// scale takes n pods (each with a pause process, as the eBPF run's)
// through the real istio-cni: its plugin's ADDs, conc in flight, each to
// the pod's in-pod chains committed; then their removal as kubelet removes
// pods, which for istio-cni is the API's delete (its plugin's DEL does
// nothing in ambient mode): every pod deleted, conc at a time, while the
// runtime runs the plugin's DELs, to the acker's ZDS del of the last pod
// and its probe ipsets naming none of them.
func (ic *istioCNI) scale(n, conc int) (istioScale, error) {
	ic.t.Helper()
	var s istioScale
	pods := ic.batch("is", n, true)
	defer func() {
		if err := ic.light.remove(pods); err != nil {
			ic.t.Errorf("remove the istio-cni scale pods: %v", err)
		}
	}()
	pid := ic.node.Agent.PID()
	if pid == 0 {
		return s, errors.New("install-cni is not running")
	}
	mem, err := procMemory(pid)
	if err != nil {
		return s, fmt.Errorf("memory of install-cni: %w", err)
	}
	s.before = mem.RSSBytes
	s.mountsBefore = mountCount(pid)
	z0 := ic.zdsCounts()
	prof := startProfiler(pid, ic.t.TempDir(), true)
	cpu0 := cpuTime(pid)
	s.add, err = ic.cni("ADD", pods, conc)
	s.addCPU = cpuTime(pid) - cpu0
	_, s.addProfile = prof.finish(istioFrames)
	if err != nil {
		return s, fmt.Errorf("ADD of %d pods: %w", n, err)
	}
	if got := ic.zdsCounts().Adds - z0.Adds; got < int64(n) {
		return s, fmt.Errorf("install-cni enrolled %d pods but handed %d to ztunnel", n, got)
	}
	if mem, err = procMemory(pid); err != nil {
		return s, fmt.Errorf("memory of install-cni: %w", err)
	}
	s.at, s.hwm = mem.RSSBytes, mem.HWMBytes
	s.mounts = mountCount(pid)
	// What kubelet reports once the pods run: istio-cni's removal takes
	// a pod's addresses out of its ipsets by the pod's status.
	for _, p := range pods {
		ic.cluster.SetStatus(ic.t, ic.kube[p.UID], kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{p.V4, p.V6}})
	}
	if err := ic.adopt(&s, n); err != nil {
		return s, err
	}
	pid = ic.node.Agent.PID()

	cpu0 = cpuTime(pid)
	t0 := time.Now()
	deleted := make(chan error, 1)
	go func() { deleted <- ic.deletePods(pods, conc) }()
	_, delErr := ic.cni("DEL", pods, conc)
	if err := errors.Join(<-deleted, delErr); err != nil {
		return s, fmt.Errorf("remove %d pods: %w", n, err)
	}
	// Removed: ztunnel told, and the pods' addresses gone from the probe
	// ipsets (install-cni does the two in its own order).
	var left error
	if !testenv.Poll(2*time.Minute, func() bool {
		if ic.zdsCounts().Dels-z0.Dels < int64(n) {
			return false
		}
		left = ic.checkIpsetsLeft(pods)
		return left == nil
	}) {
		return s, fmt.Errorf("2m after the removal of %d pods: install-cni handed %d to ztunnel as deleted; %v", n, ic.zdsCounts().Dels-z0.Dels, left)
	}
	s.remove = time.Since(t0)
	s.delCPU = cpuTime(pid) - cpu0
	return s, nil
}

// adopt restarts install-cni as a rolling update does (Agent.Restart)
// with n pods enrolled and times it until it is ready and has sent ztunnel
// a snapshot naming every pod with its netns (an add each; a keep is a pod
// whose netns it did not find in /proc).
func (ic *istioCNI) adopt(s *istioScale, n int) error {
	a := ic.node.Agent
	z := ic.zdsCounts()
	// The whole machine: the new process does not exist yet.
	prof := startMachineProfiler(ic.t.TempDir())
	if err := a.Restart(); err != nil {
		prof.stop()
		return err
	}
	var err error
	if s.ready, err = a.WaitReady(); err != nil {
		prof.stop()
		return err
	}
	var now zdsCounts
	if !testenv.Poll(2*time.Minute, func() bool {
		now = ic.zdsCounts()
		return now.Adds-z.Adds >= int64(n) || now.Keeps-z.Keeps > 0
	}) || now.Adds-z.Adds < int64(n) {
		prof.stop()
		return fmt.Errorf("restarted install-cni sent ztunnel %d adds and %d keeps for %d pods", now.Adds-z.Adds, now.Keeps-z.Keeps, n)
	}
	s.adopt = time.Since(a.Started)
	s.adoptCPU = cpuTime(a.PID())
	_, s.adoptProfile = prof.byProcess(istiocnireal.AgentBinary, istioFrames, istiocnireal.AgentBinary)
	return nil
}

// mountCount counts the mounts of process pid's mount namespace (0 when
// unreadable).
func mountCount(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return 0
	}
	return bytes.Count(b, []byte("\n"))
}

// deletePods deletes pods from the API server at once (grace 0, as
// kubelet's final delete), conc at a time.
func (ic *istioCNI) deletePods(pods []*simnode.Pod, conc int) error {
	var g errgroup.Group
	g.SetLimit(conc)
	api := ic.cluster.Client.CoreV1().Pods(ic.namespace)
	for _, p := range pods {
		g.Go(func() error {
			if err := api.Delete(context.Background(), p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
				return fmt.Errorf("delete pod %s/%s: %w", ic.namespace, p.Name, err)
			}
			return nil
		})
	}
	return g.Wait()
}

// checkIpsetsLeft fails when install-cni's probe ipsets still hold an
// address of pods (its node state of a pod outlives the pod otherwise).
func (ic *istioCNI) checkIpsetsLeft(pods []*simnode.Pod) error {
	gone := map[string]bool{}
	for _, p := range pods {
		gone[p.V4.String()], gone[p.V6.String()] = true, true
	}
	var left []string
	err := simnode.InNetns(ic.node.Node.NodeNS, func() error {
		for _, name := range []string{rules.IpsetV4, rules.IpsetV6} {
			l, err := netlink.IpsetList(name)
			if err != nil {
				return fmt.Errorf("list ipset %s: %w", name, err)
			}
			for _, e := range l.Entries {
				if gone[e.IP.String()] {
					left = append(left, e.IP.String())
				}
			}
		}
		return nil
	})
	if err == nil && len(left) > 0 {
		err = fmt.Errorf("install-cni's ipsets still hold %d addresses of removed pods, the first %s", len(left), left[0])
	}
	return err
}

func (ic *istioCNI) zdsCounts() zdsCounts { return zdsCountsOf(ic.t, ic.zt) }

func ptr[T any](v T) *T { return &v }
