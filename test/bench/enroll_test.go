// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// enrollment times enrolling fresh pods, one at a time, two ways per
// path: from a CNI plugin's exec (enroll_cni: ambient-ebpf-cni through the
// node agent, or iptables-cni doing istio-cni's work; and the real
// istio-cni's plugin through its agent, on a node of its own), and at the
// dataplane API against the reference's commands (enroll_latency, as
// before). Repetitions alternate the paths; every enrollment gets a pod
// never enrolled before.
func (e *env) enrollment(res *Results) {
	paths := []string{pathIptables, pathEBPF}
	if e.startIstio(res) {
		paths = append(paths, pathIstioCNI)
	} else {
		res.Notes["enroll_cni: the real istio-cni"] = "not measured: " + istioCNINotBuilt
	}
	p50, p99 := map[string][]float64{}, map[string][]float64{}
	cni50, cni99 := map[string][]float64{}, map[string][]float64{}
	cniCPU, delLat := map[string][]time.Duration{}, map[string][]time.Duration{}
	dist := map[string][]float64{} // every enroll_cni latency, for the chart
	var agentSide []float64
	late := 0
	// The floor: an empty static program exec'd the same way, after each
	// repetition's ebpf ADDs with the same pods' environment.
	floorBin := e.buildExecFloor()
	floor50, floor99, overFloor := map[string][]float64{}, map[string][]float64{}, []float64{}
	for rep := range e.s.reps {
		for _, name := range paths {
			if name != pathIstioCNI {
				e.enrollLatency(rep, name, p50, p99)
			}

			// The same through a CNI plugin's exec.
			pods := e.cniBatch(rep, name)
			sum0, n0 := e.agent.metric("ambient_ebpf_enroll_duration_seconds_sum"), e.agent.metric("ambient_ebpf_enroll_duration_seconds_count")
			r := e.cniEnroll(name, pods)
			late += r.Late
			if name == pathEBPF {
				if n := e.agent.metric("ambient_ebpf_enroll_duration_seconds_count") - n0; n > 0 {
					agentSide = append(agentSide, 1000*(e.agent.metric("ambient_ebpf_enroll_duration_seconds_sum")-sum0)/n)
				}
				d := e.cniRemove(pods)
				delLat[name] = append(delLat[name], d.Latencies...)
			}
			cniCPU[name] = append(cniCPU[name], r.PluginCPU/time.Duration(len(pods)))
			lat := slices.Sorted(slices.Values(r.Latencies))
			for _, d := range r.Latencies {
				dist[name] = append(dist[name], ms(d))
			}
			cni50[name] = append(cni50[name], ms(percentile(lat, 50)))
			cni99[name] = append(cni99[name], ms(percentile(lat, 99)))
			if name == pathEBPF {
				f := slices.Sorted(slices.Values(e.execFloor(floorBin, pods).Latencies))
				floor50[pathEBPF] = append(floor50[pathEBPF], ms(percentile(f, 50)))
				floor99[pathEBPF] = append(floor99[pathEBPF], ms(percentile(f, 99)))
				if p := ms(percentile(f, 99)); p > 0 {
					overFloor = append(overFloor, ms(percentile(lat, 99))/p)
				}
			}
		}
	}
	// One more batch per path, profiled: the sampling would weigh on the
	// figures' own batches. First the plugin's start alone: exec of CNI
	// VERSION, which answers without any work.
	for _, name := range paths {
		pods := e.cniBatch(e.s.reps, name)
		v, err := e.cni(name, "VERSION", pods, 1)
		if err != nil {
			e.t.Fatalf("CNI VERSION on %s: %v", name, err)
		}
		lat := slices.Sorted(slices.Values(v.Latencies))
		res.Notes["enroll_cni: the plugin's start alone (exec of CNI VERSION to its exit), "+name] = fmt.Sprintf("p50 %.2f ms, p99 %.2f ms; %.2f ms CPU per exec",
			ms(percentile(lat, 50)), ms(percentile(lat, 99)), ms(v.PluginCPU)/float64(len(pods)))
		if name == pathEBPF {
			f := e.execFloor(floorBin, pods)
			fl := slices.Sorted(slices.Values(f.Latencies))
			res.Notes["enroll_cni: the empty program's exec right after (exec_floor_ms, the same pods)"] = fmt.Sprintf("p50 %.2f ms, p99 %.2f ms; %.2f ms CPU per exec",
				ms(percentile(fl, 50)), ms(percentile(fl, 99)), ms(f.PluginCPU)/float64(len(pods)))
		}
		dir := e.t.TempDir()
		machine := startMachineProfiler(dir)
		var agent *profiler
		if name == pathEBPF {
			agent = startProfiler(e.agent.Agent.PID(), dir, true)
		}
		e.cniEnroll(name, pods)
		focus := ""
		if name == pathEBPF {
			focus = "ambient-ebpf-cn"
		}
		shares, plugin := machine.byProcess(focus, pluginFrames,
			"ambient-ebpf-ag", "ambient-ebpf-cn", iptablesPlugin, istiocnireal.PluginBinary, istiocnireal.AgentBinary, "iptables-restor", "ip6tables-resto",
			"kube-apiserver", "etcd", "bench.test")
		res.Notes["enroll_cni: CPU by process while enrolling one at a time (perf -a, share of all samples, one extra batch), "+name] = shares
		if focus != "" {
			res.Notes["enroll_cni: plugin CPU profile (perf -a, cumulative, share of the plugin processes' samples, one extra batch), ebpf"] = plugin
		}
		if agent != nil {
			waits, cpu := agent.finish(agentFrames)
			res.Notes["enroll_cni: where the agent's threads wait in the kernel (one extra batch), ebpf"] = waits
			res.Notes["enroll_cni: agent CPU profile (perf, one extra batch), ebpf"] = cpu
			e.cniRemove(pods)
		}
	}
	const cniNote = "per repetition, BENCH_ENROLL_PODS fresh pods per path, one ADD at a time; the time from the exec of the plugin " +
		"(stdin: its entry of the chained conflist with name, cniVersion and the primary plugin's prevResult, as libcni builds it; CNI_* and " +
		"K8S_POD_* in the environment) to its exit 0 and redirection in place. ebpf: cmd/ambient-ebpf-cni, which asks the node agent " +
		"(enrollment, then ZDS to a ztunnel that acks at once); in place = the pod's netns cookie is a key of the pinned ae_netns map, looked " +
		"up right after the exit inside the timed window (and the dataplane's read-only pinned view lists the pod with that cookie, checked " +
		"after the batch). iptables: test/reference/iptables-cni doing istio-cni's work in the plugin process (ipset add by netlink in the " +
		"node netns, iptables-restore per family in the pod netns, ip rule/route by netlink; no agent hop, no ZDS); in place = its exit 0 " +
		"after iptables-restore committed, with iptables-save and the ipsets checked after the batch"
	const floorNote = "the floor under any plugin's start on this machine: per repetition, right after the ebpf path's ADDs and with " +
		"the same pods' environment, the exec of an empty static Go program (func main(){}, CGO_ENABLED=0, built as the plugins are) " +
		"to its exit, one at a time, through the same runtime helper and exec as the plugins (timed as their start alone, CNI VERSION, is); " +
		"in the ebpf column, the path whose exec it bounds"
	// The real istio-cni has figures of its own (istioCNIFigures), not a
	// variant of ebpf's.
	ours50, ours99 := maps.Clone(cni50), maps.Clone(cni99)
	delete(ours50, pathIstioCNI)
	delete(ours99, pathIstioCNI)
	res.Figures = append(res.Figures,
		newFigure("enroll_cni_p50", "ms", "lower", "", ours50).WithNote(cniNote),
		newFigure("enroll_cni_p99", "ms", "lower", "ebpf <= 5 ms and <= 3x exec_floor_ms_p99 (issue 36)", ours99).WithNote("as enroll_cni_p50"),
		newFigure("exec_floor_ms_p50", "ms", "lower", "", floor50).WithNote(floorNote),
		newFigure("exec_floor_ms_p99", "ms", "lower", "", floor99).WithNote("as exec_floor_ms_p50"),
		newFigure("enroll_latency_p50", "ms", "lower", "", p50).WithNote("kept for comparison: ebpf is dataplane.Enroll in a process of its own "+
			"(the CNI plugin and the agent are not included); iptables is the reference's eight commands (nsenter iptables-restore, ip, ipset)"),
		newFigure("enroll_latency_p99", "ms", "lower", "", p99).WithNote("as enroll_latency_p50"),
	)
	if e.istio != nil {
		istioCNIFigures(res, cni50, cni99)
	}
	if res.Distributions == nil {
		res.Distributions = map[string]map[string][]float64{}
	}
	res.Distributions["enroll_cni_ms"] = dist
	for _, name := range paths {
		res.Notes["enroll_cni: plugin process CPU per ADD, "+name] = fmt.Sprintf("%.2f ms (user+system of the plugin and what it runs, median of the repetitions)",
			ms(medianDuration(cniCPU[name])))
	}
	if r := summarize(overFloor); r != nil {
		res.Notes["enroll_cni: enroll_cni_p99 over exec_floor_ms_p99, ebpf"] = fmt.Sprintf("%.2fx (median of the repetitions' ratios, %.2fx to %.2fx; target <= 3x)",
			r.Median, r.Min, r.Max)
	}
	if len(agentSide) > 0 {
		res.Notes["enroll_cni: agent-side time per ADD, ebpf"] = fmt.Sprintf("%.2f ms (median of the repetitions' means of ambient_ebpf_enroll_duration_seconds: dataplane enrollment plus the ZDS ack)",
			summarize(agentSide).Median)
	}
	if d := slices.Sorted(slices.Values(delLat[pathEBPF])); len(d) > 0 {
		res.Notes["enroll_cni: DEL, ebpf"] = fmt.Sprintf("p50 %.2f ms, p99 %.2f ms (exec of ambient-ebpf-cni DEL to exit 0 and the ae_netns entry gone)",
			ms(percentile(d, 50)), ms(percentile(d, 99)))
	}
	if late > 0 {
		res.Notes["enroll_cni: checks that did not hold at the plugin's exit"] = fmt.Sprintf("%d (polled until they did; the figure includes the wait)", late)
	}
}

// startIstio starts the real istio-cni's node unless it runs, and says
// whether it does (not without the istiocnireal tag).
func (e *env) startIstio(res *Results) bool {
	if e.istio == nil {
		if e.istio = startIstioCNI(e.t); e.istio == nil {
			return false
		}
	}
	res.Config["istio-cni"] = e.istio.version() + ": install-cni as istio-cni's chart (profile=ambient) runs it, on a simulated node of its own (test/istiocnireal) against a real kube-apiserver, its ZDS peer the same acker as ours"
	return true
}

// istioCNINotBuilt says why a run has no istio-cni column.
const istioCNINotBuilt = "the real istio-cni's column is built with the istiocnireal tag (make bench builds with it)"

// istioCNIFigures adds the real istio-cni's enroll_cni figures, p50 and
// p99 of each repetition: istio-cni in the iptables column (it is
// iptables), ours in the ebpf column, so the ratio column is ours over
// the real istio-cni's; and the median of the repetitions' ratios.
func istioCNIFigures(res *Results, cni50, cni99 map[string][]float64) {
	const note = "as enroll_cni_p50, with the real istio-cni in the iptables column and ambient-ebpf's enroll_cni in the ebpf column " +
		"(the same repetitions). istio-cni: Istio's plugin istio-cni, chained by install-cni into its node's conflist and exec'd from " +
		"there by the same runtime helper, in that node's netns; in ambient mode it asks the API server whether the pod is ambient, " +
		"then its node agent (install-cni, running as istio-cni's chart runs it: test/istiocnireal), which writes the in-pod rules " +
		"(iptables-restore per family), adds the pod's addresses to its ipsets, hands the pod to the same ZDS acker as ours, annotates " +
		"the pod in the API server, then answers; pods exist in the API server, in a namespace labelled istio.io/dataplane-mode=ambient, " +
		"before their ADD. In place = the pod's netns holds istio-cni's nat chain ISTIO_OUTPUT in both families (nf_tables over netlink), " +
		"looked up right after the exit inside the timed window, with iptables-save and the ipsets checked after the batch"
	res.Figures = append(res.Figures,
		newFigure("enroll_cni_istiocni_p50", "ms", "lower", "", map[string][]float64{pathIptables: cni50[pathIstioCNI], pathEBPF: cni50[pathEBPF]}).WithNote(note),
		newFigure("enroll_cni_istiocni_p99", "ms", "lower", "", map[string][]float64{pathIptables: cni99[pathIstioCNI], pathEBPF: cni99[pathEBPF]}).WithNote("as enroll_cni_istiocni_p50"),
	)
	for q, by := range map[string]map[string][]float64{"p50": cni50, "p99": cni99} {
		var ratios []float64
		for i, ours := range by[pathEBPF] {
			if i < len(by[pathIstioCNI]) && by[pathIstioCNI][i] > 0 {
				ratios = append(ratios, ours/by[pathIstioCNI][i])
			}
		}
		if r := summarize(ratios); r != nil {
			res.Notes["enroll_cni: ebpf over the real istio-cni, "+q] = fmt.Sprintf("%.2fx (median of the repetitions' ratios of enroll_cni_%s, %.2fx to %.2fx)",
				r.Median, q, r.Min, r.Max)
		}
	}
}

// enrollLatency times repetition rep's enrollments of fresh pods on path
// (iptables or ebpf) at the dataplane API, or by the reference's
// commands, into the repetition's p50 and p99.
func (e *env) enrollLatency(rep int, name string, p50, p99 map[string][]float64) {
	pods, err := e.light.add(fmt.Sprintf("e%d%s", rep, name[:1]), e.s.enrollPods)
	if err != nil {
		e.t.Fatalf("make pods: %v", err)
	}
	var lat []time.Duration
	switch name {
	case pathEBPF:
		r, err := e.enroll(pods)
		if err != nil {
			e.t.Fatalf("enroll: %v", err)
		}
		lat = r.Latencies
		if err := e.remove(pods); err != nil {
			e.t.Fatalf("remove: %v", err)
		}
	case pathIptables:
		for _, p := range pods {
			t0 := time.Now()
			e.ipt.Enroll(e.t, p, podopts.Options{DNSCapture: true})
			lat = append(lat, time.Since(t0))
		}
	}
	slices.Sort(lat)
	p50[name] = append(p50[name], ms(percentile(lat, 50)))
	p99[name] = append(p99[name], ms(percentile(lat, 99)))
}

// cniBatch makes the pods of repetition rep's CNI enrollment on path:
// for ebpf those the agent's pod file names, for istio-cni pods of its
// node and the API server.
func (e *env) cniBatch(rep int, path string) []*simnode.Pod {
	var pods []*simnode.Pod
	var err error
	switch path {
	case pathIstioCNI:
		return e.istio.batch(fmt.Sprintf("r%d-", rep), e.s.enrollPods, false)
	case pathEBPF:
		pods = e.cniPods[rep]
		err = e.light.create(pods, false)
	default:
		pods, err = e.light.add(fmt.Sprintf("i%d-", rep), e.s.enrollPods)
	}
	if err != nil {
		e.t.Fatalf("make pods: %v", err)
	}
	return pods
}

// cniEnroll and cniRemove run the path's CNI ADDs, or DELs, one at a time.
func (e *env) cniEnroll(path string, pods []*simnode.Pod) cniResult {
	r, err := e.cni(path, "ADD", pods, 1)
	if err != nil {
		e.t.Fatalf("CNI ADD on %s: %v", path, err)
	}
	return r
}

func (e *env) cniRemove(pods []*simnode.Pod) cniResult {
	r, err := e.cni(pathEBPF, "DEL", pods, 1)
	if err != nil {
		e.t.Fatalf("CNI DEL on ebpf: %v", err)
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func medianDuration(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}
