// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package soak

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/cniexec"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The soak's shape.
const (
	stableMesh = 2  // pods in the mesh from start to end, never churned
	maxChurn   = 6  // churn pods alive at once at most
	addrPool   = 10 // churn addresses, reused by new pods
	appPort    = 8080
	echoPort   = 9090
	// converge bounds how long every pod may take, after the last fault,
	// to reach its desired state in the pins and the API server.
	converge = time.Minute
	// pluginRetry bounds a pod's CNI ADD retries, as kubelet retries a
	// sandbox; the agent or the API server may be away meanwhile.
	pluginRetry = 90 * time.Second
	leakEvery   = 10 * time.Second
)

// The states a pod is in, as the soak observed them.
const (
	meshed = "meshed" // pinned and annotated enabled: every connection passes ztunnel
	plain  = "plain"  // neither: no connection is captured
	moving = "moving" // on its way: connections are counted, not judged
	// pending: pinned, but the agent reports ztunnel has not acked it (a
	// NACK): a connection may fail, and one that does not must have
	// passed ztunnel.
	pending = "pending"
)

type pod struct {
	name   string
	kp     *corev1.Pod
	sp     *simnode.Pod
	app    *simnode.App
	addr   int  // index in the churn address pool; -1: a fixed pod
	stable bool // never churned
	nsOnly bool // in the mesh by its namespace's label alone

	// Under soak.mu: DNS capture turned off by annotation
	// (dns_capture_flip).
	dnsOff bool

	// Under soak.mu.
	wantIn bool
	gone   bool
	state  string
	epoch  int // counts state changes: a sample across one is not judged
}

type soak struct {
	t     *testing.T
	set   settings
	sch   *schedule
	c     *kubeapi.Cluster
	r     *agentrun.Node
	mesh  string // namespaces
	other string
	out   *simnode.App // the outside host: inbound client, outbound server
	rep   *report
	sm    *sampler

	mu      sync.Mutex
	pods    []*pod
	zts     []*ztRun
	free    []int
	apiDown bool
	active  fault // the fault under way; empty between faults

	head, release *build
	running       *build // the build the agent runs now
	dnsLax        bool   // see switchRelease
	churned       int    // churn pods made so far (names)
}

// build is an agent build and how it is started: its binary, the CNI
// plugin its installer copies (the fallback beside it), its extra flags,
// and the flags of agentrun's command line it does not know.
type build struct {
	name          string
	agent, plugin string
	args, omit    []string
	// dnsByNamespaceLost: each start of this build re-applies the pods in
	// the mesh by their namespace's label alone with DNS capture off (its
	// snapshot decides without the namespace). v0.1.0 does; the README's
	// rollback note says so, and test/kubee2e's
	// TestUpgradeFromTheLastReleaseRestoresDNSCapture holds it.
	dnsByNamespaceLost bool
	// retriesNACKs: a NACKed snapshot entry is retried (the pod pending
	// meanwhile). v0.1.0 logs it and goes on, as istio-cni does: the pod
	// stays unserved, its annotation enabled, until ztunnel restarts.
	retriesNACKs bool
}

// lastRelease is the last release as a build.
func lastRelease(t *testing.T) *build {
	r := agentrun.LastRelease(t)
	old := r.Version == "v0.1.0"
	return &build{name: r.Version, agent: r.Agent, plugin: r.Plugin, omit: r.Omit, dnsByNamespaceLost: old, retriesNACKs: !old}
}

// ztRun is one ztunnel stand-in's life.
type ztRun struct {
	z             *simnode.Ztunnel
	started, gone time.Time
	// stopping is when its stop began: from then on it closes the
	// connections it carries, before its process has exited (gone).
	stopping time.Time
	flaky    bool // acks late and NACKs its first adds (ztunnel_flaky)
}

// TestSoak is the chaos soak: faults drawn from a seed, together, while
// the sampler checks that no connection to or from a meshed pod bypasses
// ztunnel, that no connection of a pod outside the mesh is captured, that
// no stream through ztunnel breaks unless its ztunnel went, that every pod
// converges after the last fault, and that nothing leaks.
func TestSoak(t *testing.T) {
	set, err := readSettings()
	if err != nil {
		t.Fatal(err)
	}
	c := kubeapi.Require(t, cluster, clusterErr)
	if set.report == "" {
		set.report = filepath.Join(t.TempDir(), "soak-report.json")
	}
	s := &soak{t: t, set: set, sch: newSchedule(set.seed, set.only...), c: c, rep: newReport(set)}
	replay := fmt.Sprintf("SOAK_SEED=%d SOAK_DURATION=%s", set.seed, set.duration)
	if len(set.only) > 0 {
		replay += fmt.Sprintf(" SOAK_FAULTS=%s", os.Getenv("SOAK_FAULTS"))
	}
	t.Logf("soak: seed %d, %s; replay with %s", set.seed, set.duration, replay)
	t.Cleanup(func() {
		if t.Failed() {
			// What the run saw up to its failure, kept past the test.
			s.set.report = filepath.Join(os.TempDir(), fmt.Sprintf("ambient-ebpf-soak-%d.json", set.seed))
			if s.sm != nil {
				s.rep.Samples, s.rep.Violations = s.sm.outcomes(), s.sm.violations()
			}
			s.writeReport()
			t.Logf("soak failed: replay with %s", replay)
		}
	})
	s.setUp()
	sm := s.startSampler()
	s.sm = sm
	t.Cleanup(sm.halt) // before the helpers it dials through stop

	end := time.Now().Add(set.duration)
	nextLeak := time.Now()
	for time.Now().Before(end) {
		s.idle(s.sch.pause(500*time.Millisecond, 3*time.Second), &nextLeak)
		f := s.sch.next()
		start := time.Now()
		s.setActive(f)
		done := s.inject(f)
		s.setActive("")
		s.rep.fault(f, done, time.Since(start))
		if v := sm.violations(); len(v) > 0 {
			sm.halt()
			s.diagnose()
			t.Fatalf("soak: invariant broken after %s (seed %d):\n%s", f, set.seed, strings.Join(v, "\n"))
		}
	}
	// The last fault is over: HEAD runs again, everything converges, the
	// traffic goes on.
	if s.build() == s.release {
		s.rep.fault(releaseSwitch, s.switchRelease(), 0)
	}
	took := s.converge()
	s.rep.Convergence = took.Round(time.Millisecond).String()
	s.idle(3*time.Second, &nextLeak)
	sm.halt()
	sm.lateCaptures(s)
	sm.checkLost(s)
	s.rep.Samples, s.rep.Violations = sm.outcomes(), sm.violations()
	s.rep.leak(s.leakSample())
	s.checkLeaks()
	if v := sm.violations(); len(v) > 0 {
		s.diagnose()
		t.Errorf("soak: invariant broken (seed %d):\n%s", set.seed, strings.Join(v, "\n"))
	}
	s.writeReport()
}

// setUp starts the node: namespaces, the agent's DaemonSet (so a SIGTERM
// keeps the state, as in a rolling update), the pods that stay, ztunnel
// and the agent.
func (s *soak) setUp() {
	t := s.t
	s.mesh = s.c.Namespace(t, "soak", map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}).Name
	s.other = s.c.Namespace(t, "plain", nil).Name
	s.c.DaemonSet(t, s.mesh, "ambient-ebpf")
	s.r = agentrun.New(t, simnode.New(t), agentrun.Options{NodeName: "soak-" + testenv.RunID(),
		Kube: &agentrun.Kube{Server: s.c.Config.Host, Token: s.c.Config.BearerToken, DaemonSetNamespace: s.mesh, DaemonSetName: "ambient-ebpf"},
		// The installer's default, as users run it: an owned conflist.
		InstallCNI: true, OwnedConflist: agent.DefaultOwnedConflist, CallerNetns: true})
	if err := os.WriteFile(filepath.Join(s.r.CNIConfDir, "10-primary.conflist"),
		[]byte(`{"cniVersion": "1.0.0", "name": "primary", "plugins": [{"type": "ptp"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range addrPool {
		s.free = append(s.free, i)
	}
	s.head = &build{name: "HEAD", agent: s.r.Bin, plugin: s.r.Plugin, retriesNACKs: true}
	s.release = lastRelease(t)
	s.setBuild(s.head, false)

	s.out = s.r.StartOutsideApp()
	s.out.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	if _, err := s.out.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), echoPort)}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.out.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		t.Fatal(err)
	}
	// The fixed pods run before the agent: its start enrols them. m0 is
	// in the mesh by its namespace's label, m1 by its own too.
	for i := range stableMesh {
		var labels map[string]string
		if i%2 == 1 {
			labels = map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}
		}
		s.fixedPod(fmt.Sprintf("m%d", i), s.mesh, 200+i, labels, true)
	}
	s.fixedPod("p0", s.other, 220, nil, false)
	s.startZtunnel()
	s.startAgent(true)
	if took := s.converge(); took > 0 {
		t.Logf("soak: the fixed pods converged in %s", took.Round(time.Millisecond))
	}
}

func podAddrs(i int) (netip.Addr, netip.Addr) {
	return netip.AddrFrom4([4]byte{198, 18, 5, byte(10 + i)}), netip.MustParseAddr(fmt.Sprintf("fd00:198:18:5::%x", 10+i))
}

// fixedPod makes a running pod with its app, before the agent starts.
func (s *soak) fixedPod(name, ns string, addr int, labels map[string]string, in bool) {
	v4, v6 := podAddrs(addr)
	kp := s.c.Pod(s.t, kubeapi.PodSpec{Namespace: ns, Name: name, Node: s.r.NodeName, Labels: labels})
	sp := s.r.AddPodWith(name, ns, string(kp.UID), v4, v6)
	kp = s.c.SetStatus(s.t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{v4, v6}})
	app := s.r.StartApp(sp)
	app.Listen("tcp", name, netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	p := &pod{name: name, kp: kp, sp: sp, app: app, addr: -1, stable: true, wantIn: in, state: moving,
		nsOnly: labels[enrollment.DataplaneModeLabel] != enrollment.DataplaneModeAmbient}
	s.mu.Lock()
	s.pods = append(s.pods, p)
	s.mu.Unlock()
}

func (s *soak) setActive(f fault) {
	s.mu.Lock()
	s.active = f
	s.mu.Unlock()
}

// fault is the fault under way, if any.
func (s *soak) fault() fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.active
}

// startAgent starts the running build's agent; with wait, until it is
// ready.
func (s *soak) startAgent(wait bool) {
	b := s.build()
	s.r.Bin, s.r.Plugin, s.r.Omit = b.agent, b.plugin, b.omit
	s.r.StartAgent(s.t, b.args...)
	if wait {
		s.waitAgent()
	}
}

func (s *soak) waitAgent() {
	if _, err := s.r.WaitReady(); err != nil {
		s.t.Fatalf("soak (seed %d): %v", s.set.seed, err)
	}
}

// startZtunnel starts a stand-in against the agent's ZDS socket, with
// extra environment (simnode.ZDSAckDelayEnv, ZDSNackAddsEnv).
func (s *soak) startZtunnel(env ...string) *ztRun {
	z := &ztRun{z: s.r.StartZtunnelFor(s.r.ZDS, env...), started: time.Now()}
	s.mu.Lock()
	s.zts = append(s.zts, z)
	s.mu.Unlock()
	return z
}

// current is the newest stand-in.
func (s *soak) current() *ztRun {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.zts[len(s.zts)-1]
}

// stopZtunnel ends a stand-in, as its pod's deletion does.
// It is gone once its process exited: until then its listeners, beside
// the new one's (SO_REUSEPORT), still take connections and record them.
func (s *soak) stopZtunnel(z *ztRun) {
	s.mu.Lock()
	z.stopping = time.Now()
	s.mu.Unlock()
	z.z.Stop()
	s.mu.Lock()
	z.gone = time.Now()
	s.mu.Unlock()
}

// waitSnapshot waits until the agent sent z its snapshot.
func (s *soak) waitSnapshot(z *ztRun) { s.waitSnapshots(z, 1) }

// waitSnapshots waits until z got n snapshots in all.
func (s *soak) waitSnapshots(z *ztRun, n int) {
	ok := testenv.Poll(time.Minute, func() bool { return snapshots(z) >= n })
	if !ok {
		s.t.Fatalf("soak (seed %d): ztunnel got %d snapshots in a minute, want %d; agent:\n%s", s.set.seed, snapshots(z), n, s.r.Agent.Output.String())
	}
}

// snapshots counts the snapshots z received so far.
func snapshots(z *ztRun) int {
	obs, err := z.z.Transcript()
	if err != nil {
		return 0
	}
	n := 0
	for _, o := range obs {
		if o.Kind == "snapshot_sent" {
			n++
		}
	}
	return n
}

// idle waits d while observing the pods (and measuring leaks when due).
func (s *soak) idle(d time.Duration, nextLeak *time.Time) {
	for end := time.Now().Add(d); time.Now().Before(end); {
		s.observe()
		if !time.Now().Before(*nextLeak) {
			s.rep.leak(s.leakSample())
			*nextLeak = time.Now().Add(leakEvery)
		}
		time.Sleep(min(200*time.Millisecond, time.Until(end)))
	}
}

// pinnedPods are the pods the agent's pins hold, by UID.
func (s *soak) pinnedPods() (map[string]bool, error) {
	view, err := inspect.OpenPinned(s.r.BPFFSDir)
	if err != nil {
		return nil, err
	}
	defer view.Close()
	pods, err := view.Pods()
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, p := range pods {
		out[p.UID] = true
	}
	return out, nil
}

// annotation is the pod's redirection annotation in the API server; ok is
// false when it could not be read.
func (s *soak) annotation(p *pod) (ann enrollment.Redirection, ok bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	kp, err := s.c.Client.CoreV1().Pods(p.kp.Namespace).Get(ctx, p.kp.Name, metav1.GetOptions{})
	if err != nil {
		return "", false
	}
	return enrollment.Redirection(kp.Annotations[enrollment.RedirectionAnnotation]), true
}

// observe moves pods that reached their desired state (pins and API
// server agree) from moving to meshed or plain, and a meshed pod the agent
// reports pending again (ztunnel refused it: a NACK) to pending, and back.
func (s *soak) observe() bool {
	pinned, err := s.pinnedPods()
	if err != nil {
		return false
	}
	s.mu.Lock()
	pods := append([]*pod(nil), s.pods...)
	apiDown := s.apiDown
	s.mu.Unlock()
	dnsPins := s.r.DNSCapture()
	all := true
	for _, p := range pods {
		s.mu.Lock()
		gone, want, state := p.gone, p.wantIn, p.state
		s.mu.Unlock()
		if gone {
			continue
		}
		if apiDown {
			all = all && state != moving
			continue
		}
		ann, ok := s.annotation(p)
		in := pinned[string(p.kp.UID)]
		enabled := ann == enrollment.RedirectionEnabled
		s.mu.Lock()
		dnsOff, lax := p.dnsOff, s.dnsLax && p.nsOnly
		s.mu.Unlock()
		// Where DNS capture was flipped, the pins must say so too.
		dnsOK := !in || lax || dnsPins[p.kp.Namespace+"/"+p.name] == !dnsOff
		settled := ok && in == want && enabled == want && dnsOK
		if ok && in && want && (state == meshed || state == pending) {
			next := pending
			if enabled {
				next = meshed
			}
			s.mu.Lock()
			if p.state != next {
				p.state, p.epoch = next, p.epoch+1
			}
			s.mu.Unlock()
		}
		if settled && state == moving {
			s.mu.Lock()
			p.state, p.epoch = plain, p.epoch+1
			if want {
				p.state = meshed
			}
			s.mu.Unlock()
		}
		all = all && settled
	}
	// No pod may be pinned that is gone or out of the mesh for good.
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.pods {
		if pinned[string(p.kp.UID)] && (p.gone || !p.wantIn) && p.state != moving {
			all = false
		}
	}
	return all
}

// converge waits until every pod is in its desired state, and returns how
// long that took; it fails the soak past converge.
func (s *soak) converge() time.Duration {
	start := time.Now()
	if testenv.Poll(converge, s.observe) {
		return time.Since(start)
	}
	s.mu.Lock()
	var states []string
	for _, p := range s.pods {
		if !p.gone {
			states = append(states, fmt.Sprintf("%s (%s, want in: %v)", p.name, p.state, p.wantIn))
		}
	}
	s.mu.Unlock()
	pinned, err := s.pinnedPods()
	s.t.Fatalf("soak (seed %d): pods not in their desired state %s after the last fault: %s; pinned %v %v; agent:\n%s",
		s.set.seed, converge, strings.Join(states, ", "), pinned, err, s.r.Agent.Output.String())
	return 0
}

// inject runs one fault to its end (the agent, ztunnel and the API server
// running again) and says what it did.
func (s *soak) inject(f fault) string {
	switch f {
	case agentKill:
		s.r.Agent.Kill()
		time.Sleep(s.sch.pause(0, 3*time.Second))
		s.startAgent(true)
	case agentTerm:
		if err := s.r.Stop(30 * time.Second); err != nil {
			s.t.Fatalf("soak (seed %d): %v", s.set.seed, err)
		}
		time.Sleep(s.sch.pause(0, 2*time.Second))
		s.startAgent(true)
	case ztunnelRoll:
		s.rollZtunnel()
	case zdsDrop:
		// ztunnel's ZDS connection breaks, its listeners stay: it
		// reconnects and gets a snapshot; no connection may fail.
		z := s.current()
		n := snapshots(z)
		if err := z.z.DropZDS(); err != nil {
			// Not connected (reconnecting after the agent's restart):
			// nothing to drop.
			return fmt.Sprintf("%s: %v", f, err)
		}
		s.waitSnapshots(z, n+1)
	case ztunnelFlaky:
		// A new ztunnel slow to answer ZDS, refusing its first adds,
		// replaces the running one; it serves until the next restart.
		// Not while a build that leaves a NACKed snapshot entry
		// unserved until ztunnel restarts runs (v0.1.0, as istio-cni):
		// a reliable one rolls in instead.
		delay := s.sch.pause(200*time.Millisecond, 2*time.Second)
		nacks := s.sch.pick(4)
		if !s.build().retriesNACKs {
			s.rollZtunnel()
			return fmt.Sprintf("%s: a reliable ztunnel instead, %s runs", f, s.build().name)
		}
		old := s.current()
		z := s.startZtunnel(simnode.ZDSAckDelayEnv+"="+delay.String(), fmt.Sprintf("%s=%d", simnode.ZDSNackAddsEnv, nacks))
		z.flaky = true
		s.waitSnapshot(z)
		time.Sleep(s.sch.pause(0, time.Second))
		s.stopZtunnel(old)
		return fmt.Sprintf("%s (acks after %s, the first %d adds NACKed)", f, delay.Round(time.Millisecond), nacks)
	case ztunnelCrash:
		s.stopZtunnel(s.current())
		time.Sleep(s.sch.pause(0, 2*time.Second))
		s.waitSnapshot(s.startZtunnel())
	case apiOutage, apiAndAgent:
		s.apiOutage(f == apiAndAgent)
	case releaseSwitch:
		return s.switchRelease()
	case dnsFlip:
		return s.flipDNS()
	case podAdd, podAddAgentDn:
		if s.alive() >= maxChurn {
			return s.podDel()
		}
		return s.podAdd(f == podAddAgentDn)
	case podDel:
		if s.alive() == 0 {
			return s.podAdd(false)
		}
		return s.podDel()
	case podLabelOut, podLabelIn:
		return s.label(f == podLabelIn)
	}
	return string(f)
}

// rollZtunnel restarts ztunnel the way it rolls: a new one connects and
// gets its snapshot, then the old one exits.
func (s *soak) rollZtunnel() {
	old := s.current()
	z := s.startZtunnel()
	s.waitSnapshot(z)
	time.Sleep(s.sch.pause(0, time.Second))
	s.stopZtunnel(old)
}

// switchRelease rolls the node back to the last release, as the README
// says (the agent restarted with the values the release knows, then the
// release's agent), or upgrades it to HEAD again. DNS of pods in the mesh
// by their namespace alone is not judged from the release's start until
// HEAD, back, has restored their DNS capture (dnsByNamespaceLost).
func (s *soak) switchRelease() string {
	stop := func() {
		if err := s.r.Stop(30 * time.Second); err != nil {
			s.t.Fatalf("soak (seed %d): %v", s.set.seed, err)
		}
	}
	if s.build() == s.release {
		stop()
		s.setBuild(s.head, true)
		s.startAgent(true)
		took, ok := s.dnsRestored()
		if !ok {
			s.fail("HEAD, back after %s, did not restore DNS capture of every pod in the mesh within %s", s.release.name, took)
		}
		s.setBuild(s.head, false)
		return fmt.Sprintf("upgrade from %s to HEAD (DNS capture restored in %s)", s.release.name, took.Round(time.Millisecond))
	}
	if s.current().flaky && !s.release.retriesNACKs {
		// Its NACKs left would go unretried (see ztunnel_flaky); rolled
		// while an agent runs to send the new one its snapshot.
		s.rollZtunnel()
	}
	stop()
	// The values the README says to set before rolling a node back to
	// v0.1.0.
	s.setBuild(&build{name: "HEAD before a rollback", agent: s.head.agent, plugin: s.head.plugin,
		args: []string{"--pods-cgroup=none", "--host-probes=snat"}, retriesNACKs: true}, false)
	s.startAgent(true)
	time.Sleep(s.sch.pause(0, 2*time.Second))
	stop()
	s.setBuild(s.release, s.release.dnsByNamespaceLost)
	s.startAgent(true)
	return "rollback from HEAD to " + s.release.name
}

// flipDNS turns DNS capture off for a fixed pod in the mesh by its
// annotation, or on again. The pod is moving until its pinned flags say
// so; a query of a pod with capture off must reach the server it asked.
func (s *soak) flipDNS() string {
	p := s.pick(func(p *pod) bool { return p.stable && p.wantIn })
	s.mu.Lock()
	off := !p.dnsOff
	p.dnsOff, p.state, p.epoch = off, moving, p.epoch+1
	s.mu.Unlock()
	v := `"false"`
	if !off {
		v = "null"
	}
	patch := []byte(`{"metadata":{"annotations":{"` + enrollment.DNSCaptureAnnotation + `":` + v + `}}}`)
	if _, err := s.c.Client.CoreV1().Pods(p.kp.Namespace).Patch(context.Background(), p.name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		s.t.Fatal(err)
	}
	return fmt.Sprintf("%s: %s=%s", p.name, enrollment.DNSCaptureAnnotation, v)
}

// build is the build the agent runs.
func (s *soak) build() *build {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running
}

// setBuild names the build the next start runs; dnsLax says whether DNS
// of the pods in the mesh by namespace alone is left unjudged.
func (s *soak) setBuild(b *build, dnsLax bool) {
	s.mu.Lock()
	s.running, s.dnsLax = b, dnsLax
	s.mu.Unlock()
}

// dnsRestored waits until every pinned pod's DNS capture is as wanted
// again.
func (s *soak) dnsRestored() (time.Duration, bool) {
	start := time.Now()
	ok := testenv.Poll(30*time.Second, func() bool {
		capture := s.r.DNSCapture()
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, p := range s.pods {
			// A pod pinned with its DNS capture as wanted: on, but
			// where dns_capture_flip turned it off.
			if on, pinned := capture[p.kp.Namespace+"/"+p.name]; pinned && on == p.dnsOff {
				return false
			}
		}
		return capture != nil
	})
	return time.Since(start), ok
}

func (s *soak) apiOutage(agentToo bool) {
	if err := s.c.KillAPIServer(); err != nil {
		s.t.Fatal(err)
	}
	s.mu.Lock()
	s.apiDown = true
	s.mu.Unlock()
	time.Sleep(s.sch.pause(500*time.Millisecond, 2*time.Second))
	if agentToo {
		// The agent starts while the API server is away: it must not
		// become ready on a view it could not list, nor drop a pod.
		s.r.Agent.Kill()
		s.startAgent(false)
	}
	time.Sleep(s.sch.pause(time.Second, 5*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := s.c.StartAPIServer(ctx); err != nil {
		s.t.Fatalf("soak (seed %d): %v", s.set.seed, err)
	}
	s.mu.Lock()
	s.apiDown = false
	s.mu.Unlock()
	if agentToo {
		s.waitAgent()
	}
}

func (s *soak) alive() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, p := range s.pods {
		if !p.stable && !p.gone {
			n++
		}
	}
	return n
}

// cniCall prepares the real plugin's exec for p, with the conflist a
// runtime selects: the first of the folder, by name.
func (s *soak) cniCall(p *simnode.Pod) *cniexec.Call {
	files, err := libcni.ConfFiles(s.r.CNIConfDir, []string{".conflist"})
	if err != nil || len(files) == 0 {
		s.t.Fatalf("no conflist in %s: %v", s.r.CNIConfDir, err)
	}
	slices.Sort(files)
	list, err := libcni.ConfListFromFile(files[0])
	if err != nil {
		s.t.Fatal(err)
	}
	call, err := cniexec.NewCall(list, "ambient-ebpf-cni", s.r.CNIBinDir, cniexec.FromSimnode(p)[0])
	if err != nil {
		s.t.Fatal(err)
	}
	return call
}

// execRetried runs a plugin command until it succeeds, as kubelet retries
// a sandbox, and returns how many attempts failed.
func (s *soak) execRetried(call *cniexec.Call, cmd string) int {
	failed := 0
	backoff := 200 * time.Millisecond
	for deadline := time.Now().Add(pluginRetry); ; {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := call.Exec(ctx, cmd)
		cancel()
		if err == nil {
			return failed
		}
		failed++
		if time.Now().After(deadline) {
			s.t.Fatalf("soak (seed %d): %v (tried %d times)", s.set.seed, err, failed)
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, 2*time.Second)
	}
}

// podAdd adds a pod as kubelet does: in the API server, its sandbox, the
// CNI ADD (retried), Running, its app. With agentDown the agent is killed
// first: the plugin must refuse the ambient pod (fail closed) until the
// agent is back.
func (s *soak) podAdd(agentDown bool) string {
	s.mu.Lock()
	i := s.sch.pick(len(s.free))
	addr := s.free[i]
	s.free = append(s.free[:i], s.free[i+1:]...)
	s.churned++
	name := fmt.Sprintf("c%d", s.churned)
	s.mu.Unlock()
	v4, v6 := podAddrs(addr)
	kp := s.c.Pod(s.t, kubeapi.PodSpec{Namespace: s.mesh, Name: name, Node: s.r.NodeName})
	sp := s.r.AddPodWith(name, s.mesh, string(kp.UID), v4, v6)
	p := &pod{name: name, kp: kp, sp: sp, addr: addr, wantIn: true, state: moving, nsOnly: true}
	s.mu.Lock()
	s.pods = append(s.pods, p)
	s.mu.Unlock()
	call := s.cniCall(sp)
	what := string(podAdd)
	if agentDown {
		s.r.Agent.Kill()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := call.Exec(ctx, "ADD")
		cancel()
		if err == nil {
			s.fail("the CNI plugin let ambient pod %s/%s start while the agent was down (not fail-closed)", s.mesh, name)
		}
		s.startAgent(false)
		what = string(podAddAgentDn)
	}
	if n := s.execRetried(call, "ADD"); n > 0 {
		what += fmt.Sprintf(" (ADD failed %d times first)", n)
	}
	if agentDown {
		s.waitAgent()
	}
	p.kp = s.c.SetStatus(s.t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: []netip.Addr{v4, v6}})
	app := s.r.StartApp(sp)
	app.Listen("tcp", name, netip.AddrPortFrom(netip.IPv6Unspecified(), appPort))
	s.mu.Lock()
	p.app = app
	s.mu.Unlock()
	return what
}

// podDel deletes a churn pod as kubelet does: its app stops, the CNI DEL,
// its sandbox's network goes, and it leaves the API server.
func (s *soak) podDel() string {
	p := s.pickChurn(func(p *pod) bool { return true })
	s.mu.Lock()
	p.state, p.epoch = moving, p.epoch+1
	app := p.app
	p.app = nil
	s.mu.Unlock()
	if app != nil {
		app.Stop()
	}
	s.execRetried(s.cniCall(p.sp), "DEL")
	s.r.DeletePodNetwork(p.sp)
	zero := int64(0)
	if err := s.c.Client.CoreV1().Pods(s.mesh).Delete(context.Background(), p.name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		s.t.Fatal(err)
	}
	s.mu.Lock()
	p.gone = true
	s.free = append(s.free, p.addr)
	s.mu.Unlock()
	return string(podDel)
}

// label moves a churn pod out of the mesh (istio.io/dataplane-mode=none),
// or back in (the label removed: its namespace is ambient).
func (s *soak) label(in bool) string {
	p := s.pickChurn(func(p *pod) bool { return p.wantIn != in && p.app != nil })
	if p == nil {
		return "nothing to label"
	}
	s.mu.Lock()
	p.state, p.epoch, p.wantIn = moving, p.epoch+1, in
	s.mu.Unlock()
	v := `"` + enrollment.DataplaneModeNone + `"`
	if in {
		v = "null"
	}
	patch := []byte(`{"metadata":{"labels":{"` + enrollment.DataplaneModeLabel + `":` + v + `}}}`)
	if _, err := s.c.Client.CoreV1().Pods(s.mesh).Patch(context.Background(), p.name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		s.t.Fatal(err)
	}
	if in {
		return string(podLabelIn)
	}
	return string(podLabelOut)
}

// pickChurn draws an alive churn pod that ok accepts; nil when none does.
func (s *soak) pickChurn(ok func(*pod) bool) *pod {
	return s.pick(func(p *pod) bool { return !p.stable && ok(p) })
}

// pick draws an alive pod that ok accepts (called under no lock; ok runs
// under s.mu); nil when none does.
func (s *soak) pick(ok func(*pod) bool) *pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	var c []*pod
	for _, p := range s.pods {
		if !p.gone && ok(p) {
			c = append(c, p)
		}
	}
	if len(c) == 0 {
		return nil
	}
	return c[s.sch.pick(len(c))]
}

// fail records a violation the sampler did not see.
func (s *soak) fail(format string, args ...any) {
	s.t.Errorf("soak (seed %d): "+format, append([]any{s.set.seed}, args...)...)
}

// diagnose logs what a violation needs explained, while the node still
// stands: the agent's last words and the socket programs on its cgroups.
func (s *soak) diagnose() {
	s.t.Logf("the agent's output (%s), its end:\n%s", s.build().name, tail(s.r.Agent.Output.String(), 120))
	out, err := exec.Command("bpftool", "cgroup", "tree", s.r.CgroupRoot).CombinedOutput()
	s.t.Logf("the socket programs on the node's cgroups (bpftool cgroup tree %s): %v\n%s", s.r.CgroupRoot, err, out)
	if view, err := inspect.OpenPinned(s.r.BPFFSDir); err == nil {
		defer view.Close()
		d, err := view.Dump()
		s.t.Logf("the pinned pods (ae_netns, ae_pod_meta): %v\n%+v\n%+v", err, d.Netns, d.Meta)
	}
}

// tail is the last n lines of text.
func tail(text string, n int) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
