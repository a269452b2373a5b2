// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cli"
	"github.com/ambient-ebpf/ambient-ebpf/test/bench/benchdoc"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// scaleConc is how many CNI calls the scale run has in flight: a kubelet
// starting pods after a node reboot.
const scaleConc = 16

// scale takes scalePods pods (each with a pause process, as real pods have)
// through the node agent's life: CNI ADDs with scaleConc in flight, the
// agent's restart adopting them all, CNI DELs with scaleConc in flight. It
// measures the times, the agent's CPU and memory, and the eBPF path's
// sequential connection rate before and after the pods are in; afterwards
// nothing of the pods may be left.
func (e *env) scale(res *Results) {
	n := e.s.scalePods
	pods := e.scalePods
	p := e.paths[pathEBPF]
	t0 := time.Now()
	if err := e.light.create(pods, true); err != nil {
		e.t.Fatalf("make %d pods: %v", n, err)
	}
	res.Notes["scale: making the pods (netns + veth + pause process, not timed)"] = time.Since(t0).Round(time.Millisecond).String()

	memBefore := e.agentMemory()
	dpMem, err := memory(e.dpapi.PID(), e.dpCfg.BPFFSDir)
	if err != nil {
		e.t.Fatalf("memory of the dataplane API process: %v", err)
	}
	res.Notes["scale: memory of a process holding only a dataplane (the dataplane API's, no pods)"] = fmt.Sprintf("RSS %.1f MiB (%.1f MiB anonymous)",
		mib(dpMem.RSSBytes), mib(dpMem.AnonBytes))
	// The eBPF path's rate, alternated with the iptables path's: the
	// iptables path goes through the same stand-in and does not depend
	// on the dataplane's pod count, so ebpf/iptables cancels the drift
	// of a shared machine.
	ref := e.paths[pathIptables]
	rateAt := func() (ebpf, norm []float64) {
		for range e.s.reps {
			r := rate(e.measure(p, loadRequest{Op: "conn", Addr: p.echo, Duration: e.s.duration}))
			ri := rate(e.measure(ref, loadRequest{Op: "conn", Addr: ref.echo, Duration: e.s.duration}))
			ebpf, norm = append(ebpf, r), append(norm, r/ri)
		}
		return ebpf, norm
	}
	at1, norm1 := rateAt()

	// Enrollment: CNI ADDs, scaleConc in flight.
	pid := e.agent.Agent.PID()
	prof := startProfiler(pid, e.t.TempDir(), true)
	cpu0, zds0 := cpuTime(pid), e.zdsCounts()
	add, err := e.cni(pathEBPF, "ADD", pods, scaleConc)
	agentCPU := cpuTime(pid) - cpu0
	waits, cpu := prof.finish(agentFrames)
	if err != nil {
		e.t.Fatalf("CNI ADD of %d pods: %v", n, err)
	}
	res.Notes["scale: where the agent's threads wait in the kernel while enrolling"] = waits
	res.Notes["scale: agent CPU profile while enrolling (perf, share of the samples)"] = cpu
	if got := e.zdsCounts().Adds - zds0.Adds; got < int64(n) {
		e.t.Fatalf("the agent enrolled %d pods but handed %d to ztunnel", n, got)
	}
	mem := e.agentMemory()
	slog.Info("scale enrolled", "pods", n, "total", add.Total, "rss_mib", mib(mem.RSSBytes))
	atN, normN := rateAt()

	// Adoption: the agent stops (pins stay) and starts again.
	adopt, adoptCPU := e.adopt(res)
	slog.Info("scale adopted", "pods", n, "total", adopt)

	// Removal: CNI DELs, scaleConc in flight.
	e.agent.waitFor("ztunnel to reconnect", func(st cli.Status) bool { return st.Agent.ZtunnelConnections > 0 })
	pid = e.agent.Agent.PID()
	prof = startProfiler(pid, e.t.TempDir(), true)
	cpu0 = cpuTime(pid)
	del, err := e.cni(pathEBPF, "DEL", pods, scaleConc)
	removeCPU := cpuTime(pid) - cpu0
	waits, cpu = prof.finish(agentFrames)
	if err != nil {
		e.t.Fatalf("CNI DEL of %d pods: %v", n, err)
	}
	res.Notes["scale: where the agent's threads wait in the kernel while removing"] = waits
	res.Notes["scale: agent CPU profile while removing (perf, share of the samples)"] = cpu
	slog.Info("scale removed", "pods", n, "total", del.Total)
	e.checkScaleLeftovers(pods)

	// The figure: per repetition, the normalized rate at N over the one
	// at 1.
	ratios := make([]float64, len(norm1))
	for i := range norm1 {
		ratios[i] = normN[i] / norm1[i]
	}
	one := func(v float64) map[string][]float64 { return map[string][]float64{pathEBPF: {v}} }
	scaleNote := fmt.Sprintf("%d pods (BENCH_SCALE_PODS), each a netns with a veth and a pause process in its pod cgroup; ", n)
	res.Figures = append(res.Figures,
		newFigure("scale_enroll_1000_s", "s", "lower", "<= 5 s", one(add.Total.Seconds())).WithNote(scaleNote+
			fmt.Sprintf("CNI ADD execs of ambient-ebpf-cni, %d in flight, from the first exec to the last pod's ae_netns entry (each call as enroll_cni)", scaleConc)),
		newFigure("scale_remove_1000_s", "s", "lower", "<= 5 s", one(del.Total.Seconds())).WithNote(
			fmt.Sprintf("the same pods' CNI DEL execs, %d in flight, to the last ae_netns entry gone, after the adoption", scaleConc)),
		newFigure("scale_adopt_1000_s", "s", "lower", "<= 1 s", one(adopt.Seconds())).WithNote(
			"the agent SIGTERMed with every pod enrolled (pins stay) and started again: from the exec to /readyz 200 with every pod adopted "+
				"(the inspection API's enrolled pods and the pinned maps' pods both at the count before)"),
		newFigure("agent_cpu_ms_per_enroll", "ms", "lower", "<= 1 ms", one(ms(agentCPU)/float64(n))).WithNote(
			"the agent process's user+system time (/proc/<pid>/stat) over scale_enroll_1000_s, divided by the pods"),
		newFigure("scale_agent_rss_mib", "MiB", "lower", "<= 64 MiB", one(mib(mem.RSSBytes))).WithNote("the node agent's VmRSS with the scale pods enrolled"),
		newFigure("scale_bpf_map_mib", "MiB", "lower", "", one(mib(mem.MapBytes))),
		newFigure("scale_rate_1000_vs_1", "ratio", "higher", ">= 0.95", map[string][]float64{pathEBPF: ratios}),
	)
	e.istioScale(res, ours{add: add.Total, del: del.Total, adopt: adopt, cpu: agentCPU, delCPU: removeCPU, adoptCPU: adoptCPU, rss: mem.RSSBytes})
	res.Notes["scale: agent CPU"] = fmt.Sprintf("enrolling %s in %s wall time (%.2f ms per pod); adopting %s; removing %s (%.2f ms per pod)",
		agentCPU.Round(time.Millisecond), add.Total.Round(time.Millisecond), ms(agentCPU)/float64(n), adoptCPU.Round(time.Millisecond),
		removeCPU.Round(time.Millisecond), ms(removeCPU)/float64(n))
	for _, c := range []struct {
		what string
		r    cniResult
	}{{"ADD", add}, {"DEL", del}} {
		lat := slices.Sorted(slices.Values(c.r.Latencies))
		note := fmt.Sprintf("p50 %.2f ms, p99 %.2f ms, max %.2f ms; plugin processes %.2f ms CPU per call", ms(percentile(lat, 50)), ms(percentile(lat, 99)),
			ms(lat[len(lat)-1]), ms(c.r.PluginCPU)/float64(n))
		if c.r.Retried > 0 {
			note += fmt.Sprintf("; %d ADDs failed and were retried after a DEL, the first: %s", c.r.Retried, c.r.FirstError)
		}
		res.Notes["scale: per-call CNI "+c.what+" latency, exec to check, "+fmt.Sprint(scaleConc)+" in flight"] = note
	}
	res.Notes["scale: agent memory"] = fmt.Sprintf("RSS %.1f MiB before (%.1f MiB of it anonymous), %.1f MiB at %d pods (%.1f MiB anonymous), peak %.1f MiB; "+
		"%d pinned maps charge %.1f MiB (preallocated, the same at 2 pods: %.1f MiB)",
		mib(memBefore.RSSBytes), mib(memBefore.AnonBytes), mib(mem.RSSBytes), n, mib(mem.AnonBytes), mib(mem.HWMBytes), mem.MapsCount, mib(mem.MapBytes), mib(memBefore.MapBytes))
	res.Notes["scale: conn_rate_seq on the ebpf path"] = fmt.Sprintf("%s conn/s at 1 enrolled pair, %s conn/s at %d more pods; "+
		"raw ratio %.2fx; relative to the iptables path alternated with it, %.2f and %.2f (the figure uses these)",
		benchdoc.Num(summarize(at1).Median), benchdoc.Num(summarize(atN).Median), n, summarize(atN).Median/summarize(at1).Median,
		summarize(norm1).Median, summarize(normN).Median)
}

// ours is the eBPF scale run's figures, for the real istio-cni's beside them.
type ours struct {
	add, del, adopt, cpu, delCPU, adoptCPU time.Duration
	rss                                    int64
}

// istioScale runs the same number of pods through the real istio-cni (on
// its node, after ours are gone) and adds its figures beside ours: the
// real istio-cni in the iptables column, as enroll_cni_istiocni_*.
func (e *env) istioScale(res *Results, o ours) {
	if !e.startIstio(res) {
		res.Notes["scale: the real istio-cni"] = "not measured: " + istioCNINotBuilt
		return
	}
	n := e.s.scalePods
	s, err := e.istio.scale(n, scaleConc)
	if err != nil {
		e.t.Fatalf("the real istio-cni's scale run: %v", err)
	}
	cols := func(istio, ebpf float64) map[string][]float64 {
		return map[string][]float64{pathIptables: {istio}, pathEBPF: {ebpf}}
	}
	const where = "the real istio-cni (test/istiocnireal, as enroll_cni_istiocni) in the iptables column, ambient-ebpf's figure of this run in the ebpf column; "
	res.Figures = append(res.Figures,
		newFigure("scale_enroll_1000_istiocni_s", "s", "lower", "", cols(s.add.Total.Seconds(), o.add.Seconds())).WithNote(where+
			fmt.Sprintf("%d pods, each with a pause process; istio-cni: its plugin's ADD execs, %d in flight, from the first exec to the last exit with the pod's in-pod chains committed; "+
				"the pods exist in the API server (ambient namespace) before", n, scaleConc)),
		newFigure("scale_remove_1000_istiocni_s", "s", "lower", "", cols(s.remove.Seconds(), o.del.Seconds())).WithNote(where+
			fmt.Sprintf("istio-cni removes a pod when the API server deletes it (its plugin's DEL does nothing in ambient mode): every pod deleted (grace 0, %d at a time) while the runtime execs the plugin's DELs, "+
				"from the first call to the acker's ZDS del of the last pod and no address of theirs left in its probe ipsets", scaleConc)),
		newFigure("scale_adopt_1000_istiocni_s", "s", "lower", "", cols(s.adopt.Seconds(), o.adopt.Seconds())).WithNote(where+
			"istio-cni: stopped as a rolling update stops it (its DaemonSet present: it leaves the pods' rules in place) with every pod enrolled and started again; "+
			"from the exec to /readyz 200 and a ZDS snapshot naming every pod with its netns (found through /host/proc: the pods' pause processes run in the node's PID namespace, "+
			"in cgroups pod<uid>/<container id>) at the acker; ebpf: scale_adopt_1000_s"),
		newFigure("agent_cpu_ms_per_enroll_istiocni", "ms", "lower", "", cols(ms(s.addCPU)/float64(n), ms(o.cpu)/float64(n))).WithNote(where+
			"the node agent's user+system time over the ADDs (install-cni's, ambient-ebpf-agent's), divided by the pods"),
		newFigure("scale_agent_rss_istiocni_mib", "MiB", "lower", "", cols(mib(s.at), mib(o.rss))).WithNote(where+
			"the node agent's VmRSS with every scale pod enrolled"),
	)
	lat := slices.Sorted(slices.Values(s.add.Latencies))
	res.Notes["scale: the real istio-cni"] = fmt.Sprintf("ADD of %d pods in %s (per call p50 %.2f ms, p99 %.2f ms, max %.2f ms; plugin processes %.2f ms CPU per call); "+
		"removal in %s; restart: ready in %s, every pod adopted in %s, %s CPU; install-cni CPU %s enrolling (%.2f ms per pod), %s removing (%.2f ms per pod); VmRSS %.1f MiB before, %.1f MiB at %d pods, peak %.1f MiB; %d mounts in its mount namespace before, %d at %d pods",
		n, s.add.Total.Round(time.Millisecond), ms(percentile(lat, 50)), ms(percentile(lat, 99)), ms(lat[len(lat)-1]), ms(s.add.PluginCPU)/float64(n),
		s.remove.Round(time.Millisecond), s.ready.Round(time.Millisecond), s.adopt.Round(time.Millisecond), s.adoptCPU.Round(time.Millisecond), s.addCPU.Round(time.Millisecond), ms(s.addCPU)/float64(n), s.delCPU.Round(time.Millisecond), ms(s.delCPU)/float64(n),
		mib(s.before), mib(s.at), n, mib(s.hwm), s.mountsBefore, s.mounts, n)
	res.Notes["scale: the real istio-cni's CPU profile while enrolling (perf, share of the samples)"] = s.addProfile
	res.Notes["scale: the real istio-cni's CPU profile while adopting (perf, share of the samples)"] = s.adoptProfile
	res.Notes["scale: ebpf over the real istio-cni"] = fmt.Sprintf("enrol %.2fx, remove %.2fx, adopt %.2fx (agent CPU %.2fx), agent CPU per enrolment %.2fx (per removal %.2fx), agent RSS %.2fx",
		o.add.Seconds()/s.add.Total.Seconds(), o.del.Seconds()/s.remove.Seconds(), o.adopt.Seconds()/s.adopt.Seconds(), ms(o.adoptCPU)/ms(s.adoptCPU), ms(o.cpu)/ms(s.addCPU), ms(o.delCPU)/ms(s.delCPU), float64(o.rss)/float64(s.at))
}

// adopt stops the node agent and starts it again, now to uninstall on its
// way out (teardown), and returns the time from the exec until it is
// ready with every pinned pod adopted, and its CPU time until then.
func (e *env) adopt(res *Results) (time.Duration, time.Duration) {
	want := len(e.pinned())
	e.agent.stop()
	if got := len(e.pinned()); got != want {
		e.t.Fatalf("the agent's stop changed the pins: %d pods pinned, %d before", got, want)
	}
	t0 := e.agent.exec("--uninstall-on-exit")
	pid := e.agent.Agent.PID()
	prof := startProfiler(pid, e.t.TempDir(), false) // perf misses the first moment
	took := e.agent.waitReady()
	adopted := func(st cli.Status) bool { return int(st.Agent.GetEnrolledPods()) == want && st.PinnedPods == want }
	if st := e.agent.status(); st.Agent == nil || !adopted(st) {
		// Ready before every pod was adopted: the figure runs on.
		e.agent.waitFor(fmt.Sprintf("%d pods adopted", want), adopted)
		took = time.Since(t0)
	}
	cpu := cpuTime(pid)
	waits, profile := prof.finish(agentFrames)
	res.Notes["scale: where the agent's threads wait in the kernel while adopting"] = waits
	res.Notes["scale: agent CPU profile while adopting (perf, share of the samples)"] = profile
	return took, cpu
}

// checkScaleLeftovers fails the run unless the removed pods left nothing:
// no pinned pod but the traffic pair, no pods/<uid> pins (sk_lookup links, tc programs), and,
// once the pods themselves are gone, no netns or cgroup of theirs.
func (e *env) checkScaleLeftovers(pods []*simnode.Pod) {
	var keep []string
	for _, name := range []string{pathEBPF, pathEBPFLean} {
		keep = append(keep, e.paths[name].client.UID, e.paths[name].server.UID)
	}
	for uid := range e.pinned() {
		if !slices.Contains(keep, uid) {
			e.t.Errorf("pod %s is still in the pinned maps after its DEL", uid)
		}
	}
	entries, err := os.ReadDir(filepath.Join(e.node.BPFFSDir, "pods"))
	if err != nil {
		e.t.Fatalf("pinned pods: %v", err)
	}
	for _, d := range entries {
		if !slices.Contains(keep, d.Name()) {
			left, _ := os.ReadDir(filepath.Join(e.node.BPFFSDir, "pods", d.Name()))
			e.t.Errorf("pins of pod %s left after its DEL: %d", d.Name(), len(left))
		}
	}
	if err := e.light.remove(pods); err != nil {
		e.t.Errorf("remove the scale pods: %v", err)
	}
	for _, p := range pods {
		for _, path := range []string{p.NetnsPath(), p.Cgroup} {
			if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
				e.t.Errorf("%s of pod %s left behind (%v)", path, p.Name, err)
			}
		}
	}
}

// teardown removes the traffic pairs through CNI DEL, stops the node agent
// (which uninstalls; the scale run restarted it so, and a run without it
// restarts it here) and the dataplane API's dataplane, and fails the run
// if anything of either is left on the node's bpffs.
func (e *env) teardown() {
	for _, name := range []string{pathEBPF, pathEBPFLean} {
		pair := e.paths[name]
		if _, err := e.cni(pathEBPF, "DEL", []*simnode.Pod{pair.client, pair.server}, 1); err != nil {
			e.t.Errorf("CNI DEL of the %s traffic pods: %v", name, err)
		}
	}
	if !slices.Contains(e.agent.flags, "--uninstall-on-exit") {
		e.agent.stop()
		e.agent.start("--uninstall-on-exit")
	}
	e.agent.stop()
	if err := call(e.dpapi, agentRequest{Op: "uninstall"}, nil); err != nil {
		e.t.Errorf("uninstall the dataplane API's dataplane: %v", err)
	}
	var left []string
	root := filepath.Dir(e.node.BPFFSDir)
	_ = filepath.WalkDir(root, func(path string, _ os.DirEntry, err error) error {
		// maps.debug and progs.debug are the kernel's own (bpf_preload).
		if err == nil && path != root && !slices.Contains([]string{"maps.debug", "progs.debug"}, strings.TrimPrefix(path, root+"/")) {
			left = append(left, path)
		}
		return nil
	})
	if len(left) > 0 {
		e.t.Errorf("left on the node's bpffs after the uninstall: %s", strings.Join(left, ", "))
	}
}

// agentMemory is the node agent's memory and its pinned maps'.
func (e *env) agentMemory() memResult {
	m, err := memory(e.agent.Agent.PID(), e.node.BPFFSDir)
	if err != nil {
		e.t.Fatalf("agent memory: %v", err)
	}
	return m
}

// agentFrames are the functions worth naming in the agent's profile: the
// agent's work and the library calls that do it, not the plumbing every
// sample passes through (the netns switch, the servers' loops, syscall
// wrappers, netlink's request execution).
var agentFrames = regexp.MustCompile(`ambient-ebpf/pkg/(dataplane|reconciler|zds|standalone|k8s)\.|ambient-ebpf/pkg/dataplane/(inspect|accel|upgrade)\.|` +
	`vishvananda/netlink\.\(\*Handle\)|cilium/ebpf\.\(\*(Map|Program)\)|cilium/ebpf/link\.|grpc|^os\.(ReadFile|WriteFile|Open)$|runtime\.(gcBgMarkWorker|mallocgc)$`)

// pluginFrames are what the CNI plugin's profile names: its own work, the
// packages' initialisers, the Go runtime's start, and the kernel's exec,
// page faults and exit (an empty program's exec pays those but the
// initialisers and its own work).
var pluginFrames = regexp.MustCompile(`ambient-ebpf/(pkg|cmd|internal)/|\.init(\.\d+)?$|^runtime\.(schedinit|main|doInit1|mallocgc|rt0_go)|^main\.|` +
	`^(bprm_execve|do_exit|exit_mmap|asm_exc_page_fault|__x64_sys_execve)$`)

func mib(b int64) float64 { return float64(b) / (1 << 20) }
