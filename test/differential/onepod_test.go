//go:build istiocnireal

// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package differential

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	current "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/nstest"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/istiocnireal"
	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// side is one implementation on a fresh node: the runtime's CNI side, the
// stand-in connected to the agent, and how to stop the agent.
type side struct {
	name     string
	nodeName string // the node's name in the API server
	node     *simnode.Node
	runtime  *istiocnireal.Runtime
	zt       *simnode.Ztunnel
	output   func() string // the agent's output, for failures
	// pidns is the PID namespace the agent sees pods' processes in (0:
	// the test's own).
	pidns int
	// stop stops the agent as a rolling update of its DaemonSet does (the
	// DaemonSet present: its plugin and the node's state stay); start
	// execs it again and waits until it is ready.
	stop, start func() error
}

// restart restarts the agent as a rolling update does.
func (s *side) restart() error {
	if err := s.stop(); err != nil {
		return err
	}
	return s.start()
}

// eachSide starts the real istio-cni, then ambient-ebpf, each on a fresh
// node of its own, and runs fn with it.
func eachSide(t *testing.T, c *kubeapi.Cluster, fn func(s *side, nodeName string)) {
	t.Helper()
	istio := func(t *testing.T, c *kubeapi.Cluster, nodeName string) *side { return istioCNISide(t, c, nodeName) }
	ours := func(t *testing.T, c *kubeapi.Cluster, nodeName string) *side { return ambientEBPFSide(t, c, nodeName) }
	for _, start := range []func(*testing.T, *kubeapi.Cluster, string) *side{istio, ours} {
		nodeName := "diff-" + testenv.RunID()
		fn(start(t, c, nodeName), nodeName)
	}
}

// observed is what a side's users and ztunnel saw for one pod.
type observed struct {
	Chain      []string
	AddErr     string
	AddExit    string // cniExit of the ADD
	Result     string // istiocnireal.Comparable
	Annotation enrollment.Redirection
	// Transcript is the stand-in's, with the pod's uid, namespace and
	// netns named as such.
	Transcript []string
}

// istioCNISide starts the real install-cni on a fresh node (on which
// before runs first).
func istioCNISide(t *testing.T, c *kubeapi.Cluster, nodeName string, before ...func(*simnode.Node)) *side {
	return istioCNISideWith(t, c, istiocnireal.Options{NodeName: nodeName}, before...)
}

// istioCNISideWith is istioCNISide with o's chart values and environment.
func istioCNISideWith(t *testing.T, c *kubeapi.Cluster, o istiocnireal.Options, before ...func(*simnode.Node)) *side {
	var zt *simnode.Ztunnel
	n := istiocnireal.StartNodeWith(t, c, o, func(n *simnode.Node, zds string) { zt = n.StartZtunnelFor(zds) }, before...)
	return &side{name: "istio-cni", nodeName: o.NodeName, node: n.Node, runtime: n.Runtime, zt: zt, output: func() string { return n.Agent.Process.Output.String() },
		pidns: n.PIDNamespace, stop: n.Agent.StopForUpdate, start: func() error {
			n.Agent.Launch()
			_, err := n.Agent.WaitReady()
			return err
		}}
}

// ambientEBPFSide starts the real ambient-ebpf agent (with flags) on a
// fresh node,
// its installer chaining its plugin into the same primary network.
func ambientEBPFSide(t *testing.T, c *kubeapi.Cluster, nodeName string, flags ...string) *side {
	n := simnode.New(t)
	ca, err := c.ServingCert()
	if err != nil {
		t.Fatal(err)
	}
	kube := &agentrun.Kube{Server: c.Config.Host, Token: c.Config.BearerToken, CA: ca, DaemonSetNamespace: ourDaemonSet.Namespace, DaemonSetName: ourDaemonSet.Name}
	a := agentrun.New(t, n, agentrun.Options{NodeName: nodeName, InstallCNI: true, CallerNetns: true, Kube: kube})
	r := istiocnireal.NewRuntime(t, n, a.CNIBinDir, a.CNIConfDir, istiocnireal.PluginsDir(t))
	// The plugin reads pods (its fallback, with the agent down) from
	// the node netns, as istio-cni's does.
	kube.PluginServer = "https://" + r.NodeAPI(c).String()
	a.StartReadyAgent(t, flags...)
	zt := n.StartZtunnelFor(a.ZDS)
	a.WaitZtunnel(t)
	return &side{name: "ambient-ebpf", nodeName: nodeName, node: n, runtime: r, zt: zt, output: func() string { return a.Agent.Output.String() },
		stop: func() error {
			// Its DaemonSet present while it stops: it keeps the node's
			// state, as in a rolling update; gone again afterwards, so
			// the test's end uninstalls.
			c.EnsureNamespace(t, ourDaemonSet.Namespace)
			c.DaemonSet(t, ourDaemonSet.Namespace, ourDaemonSet.Name)
			err := a.Stop(30 * time.Second)
			if derr := c.Client.AppsV1().DaemonSets(ourDaemonSet.Namespace).Delete(context.Background(), ourDaemonSet.Name, metav1.DeleteOptions{}); derr != nil {
				err = errors.Join(err, derr)
			}
			return err
		}, start: func() error {
			a.StartAgent(t)
			_, err := a.WaitReady()
			return err
		}}
}

// ourDaemonSet is the DaemonSet our agent's uninstall check looks for.
var ourDaemonSet = struct{ Namespace, Name string }{"istio-system", "ambient-ebpf"}

// podCase is a pod to add: its name, its namespace's labels and its own.
type podCase struct {
	name                string
	nsLabels            map[string]string
	labels, annotations map[string]string
	// namespace is an existing namespace to add the pod to (nsLabels
	// unused); empty: a new one.
	namespace string
	// hostNetwork pods get no sandbox network: kubelet runs no CNI ADD
	// for them, so only the informers see them.
	hostNetwork bool
}

// ambientApp is pod "app" in a namespace labelled ambient.
var ambientApp = podCase{name: "app", nsLabels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}

// addPod adds ambientApp (addPodAs), waiting up to 30 s for it to be
// annotated enabled.
func addPod(t *testing.T, c *kubeapi.Cluster, s *side, nodeName string) (observed, *simnode.Pod, *corev1.Pod) {
	t.Helper()
	return addPodAs(t, c, s, nodeName, ambientApp, 30*time.Second)
}

// addPodAs creates pod pc in a namespace of its own on the side's node,
// then its sandbox through the CNI chain as a runtime does, then marks it
// Running with the chain's addresses, as kubelet does; it returns what the
// side's users and ztunnel saw once the annotation was enabled or settle
// passed, and the pod on the node and in the API.
func addPodAs(t *testing.T, c *kubeapi.Cluster, s *side, nodeName string, pc podCase, settle time.Duration) (observed, *simnode.Pod, *corev1.Pod) {
	t.Helper()
	namespace, name := pc.namespace, pc.name
	if namespace == "" {
		namespace = c.Namespace(t, "diff", pc.nsLabels).Name
	} else {
		c.EnsureNamespace(t, namespace)
		name += "-" + testenv.RunID() // the namespace is both sides'
	}
	kp := c.Pod(t, kubeapi.PodSpec{Namespace: namespace, Name: name, Node: nodeName, Labels: pc.labels, Annotations: pc.annotations, HostNetwork: pc.hostNetwork})
	p := s.node.AddBarePod(kp.Name, kp.Namespace, string(kp.UID))
	var o observed
	var err error
	if o.Chain, err = s.runtime.Chain(); err != nil {
		t.Fatal(err)
	}
	var ips []netip.Addr
	if pc.hostNetwork {
		ips = []netip.Addr{simnode.NodeV4, simnode.NodeV6}
	} else {
		netns := s.runtime.Sandbox(p)
		start := time.Now()
		res, err := s.runtime.Add(p, netns)
		t.Logf("%s: CNI ADD took %s", s.name, time.Since(start).Round(time.Millisecond))
		o.AddExit = cniExit(err)
		if err != nil {
			o.AddErr = err.Error()
			return o, p, kp
		}
		o.Result = istiocnireal.Comparable(res)
		for _, ip := range res.IPs {
			a, _ := netip.AddrFromSlice(ip.Address.IP)
			ips = append(ips, a.Unmap())
		}
		p.V4, p.V6 = addrOf(res, true), addrOf(res, false)
	}
	c.SetStatus(t, kp, kubeapi.Status{Phase: corev1.PodRunning, IPs: ips})

	testenv.Poll(settle, func() bool {
		got, err := c.Client.CoreV1().Pods(kp.Namespace).Get(context.Background(), kp.Name, metav1.GetOptions{})
		if err == nil {
			o.Annotation = enrollment.Redirection(got.Annotations[enrollment.RedirectionAnnotation])
		}
		return o.Annotation == enrollment.RedirectionEnabled
	})
	o.Transcript = transcript(t, s, p)
	return o, p, kp
}

// addEnabledPod is addPod, failing the test unless the ADD succeeded and
// the pod is annotated enabled.
func addEnabledPod(t *testing.T, c *kubeapi.Cluster, s *side, nodeName string) (*simnode.Pod, *corev1.Pod) {
	t.Helper()
	o, p, kp := addPod(t, c, s, nodeName)
	if o.AddErr != "" || o.Annotation != enrollment.RedirectionEnabled {
		t.Fatalf("%s: ADD error %q, annotation %q; the agent's output:\n%s", s.name, o.AddErr, o.Annotation, s.output())
	}
	return p, kp
}

// transcript is what the side's stand-in received so far, with the pod's
// uid, namespace and netns named as such.
func transcript(t *testing.T, s *side, p *simnode.Pod) []string {
	t.Helper()
	tr, err := s.zt.Transcript()
	if err != nil {
		t.Fatal(err)
	}
	id := nstest.IdentOfPath(t, p.NetnsPath())
	var out []string
	for _, m := range tr {
		uid, namespace, netns := m.UID, m.Namespace, ""
		if uid == p.UID {
			uid = "<pod uid>"
		}
		if namespace == p.Namespace {
			namespace = "<pod namespace>"
		}
		if m.FDs > 0 {
			netns = "other netns"
			if m.NetnsDev == id.Dev && m.NetnsIno == id.Ino {
				netns = "pod netns"
			}
		}
		out = append(out, fmt.Sprintf("session %d: %s uid=%s info=%t name=%s namespace=%s sa=%q fds=%d %s",
			m.Session, m.Kind, uid, m.Info, m.Name, namespace, m.ServiceAccount, m.FDs, netns))
	}
	return out
}

func addrOf(res *current.Result, v4 bool) netip.Addr {
	for _, ip := range res.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP); ok && a.Unmap().Is4() == v4 {
			return a.Unmap()
		}
	}
	return netip.Addr{}
}

// One pod in an ambient namespace, added through the CNI chain, with the
// real istio-cni on one fresh node and with ambient-ebpf on another: the
// chain's result (exit 0, the same addresses), the annotation reaching
// enabled, and what ztunnel received (an empty snapshot, then one Add
// with the pod's uid, workload info and its netns) are the same. The
// real agent's in-pod rules are then held against test/reference's.
func TestOnePodThroughTheChainBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string]observed{}
	var istioPod *simnode.Pod
	var istioNode *simnode.Node
	eachSide(t, c, func(s *side, nodeName string) {
		o, p, _ := addPod(t, c, s, nodeName)
		t.Logf("%s observed:\n  chain %v\n  ADD error %q\n  result %s\n  annotation %q\n  ztunnel received:\n    %s",
			s.name, o.Chain, o.AddErr, o.Result, o.Annotation, strings.Join(o.Transcript, "\n    "))
		if o.AddErr != "" || o.Annotation != enrollment.RedirectionEnabled {
			t.Errorf("%s: ADD error %q, annotation %q; the agent's output:\n%s", s.name, o.AddErr, o.Annotation, s.output())
		}
		got[s.name] = o
		if s.name == "istio-cni" {
			istioPod, istioNode = p, s.node
		}
	})
	istio, ours := got["istio-cni"], got["ambient-ebpf"]
	if want := []string{"ptp", "istio-cni"}; !slices.Equal(istio.Chain, want) {
		t.Errorf("istio-cni's chain %v, want %v", istio.Chain, want)
	}
	if want := []string{"ptp", "ambient-ebpf-cni"}; !slices.Equal(ours.Chain, want) {
		t.Errorf("ambient-ebpf's chain %v, want %v", ours.Chain, want)
	}
	if istio.Result != ours.Result {
		t.Errorf("CNI results differ:\nistio-cni    %s\nambient-ebpf %s", istio.Result, ours.Result)
	}
	if istio.Annotation != ours.Annotation {
		t.Errorf("annotations differ: istio-cni %q, ambient-ebpf %q", istio.Annotation, ours.Annotation)
	}
	if !slices.Equal(istio.Transcript, ours.Transcript) {
		t.Errorf("ztunnel received different messages:\nistio-cni:\n  %s\nambient-ebpf:\n  %s",
			strings.Join(istio.Transcript, "\n  "), strings.Join(ours.Transcript, "\n  "))
	}
	if t.Failed() {
		return
	}
	if backend := compareWithReference(t, istioNode, istioPod); backend != reference.NftCompat {
		t.Errorf("istio-cni wrote its rules with %s on a node without rules, want %s", backend, reference.NftCompat)
	}
}

// compareWithReference holds the rules the real istio-cni wrote in the
// pod and on the node (its host chain and the ipsets of enrolled pods)
// against what test/reference applies to a pod of a third node (on which
// before runs first, as it ran on istio-cni's) with the chart's defaults
// (DNS capture on, IPv6 on) and the same backend, which it returns. The
// pods' addresses and uids differ by construction and are named as such.
func compareWithReference(t *testing.T, istioNode *simnode.Node, istio *simnode.Pod, before ...func(*simnode.Node)) reference.Backend {
	t.Helper()
	backend := reference.NftCompat
	if strings.Contains(reference.Run(t, istio.NetnsPath(), "", "iptables-legacy-save"), "ISTIO_") {
		backend = reference.Legacy
	}
	t.Logf("istio-cni wrote its in-pod rules with %s", backend)
	n := simnode.New(t)
	for _, f := range before {
		f(n)
	}
	ref := &reference.Iptables{Backend: backend}
	ref.Setup(t, n)
	p := n.AddPod("app")
	ref.Enroll(t, p, podopts.Options{DNSCapture: true})
	save4, save6 := string(backend)+"-save", strings.Replace(string(backend), "iptables", "ip6tables", 1)+"-save"
	for _, c := range []struct {
		where string
		argv  []string
	}{
		{"pod", []string{save4}}, {"pod", []string{save6}},
		{"pod", []string{"ip", "-4", "rule", "show"}}, {"pod", []string{"ip", "-6", "rule", "show"}},
		{"pod", []string{"ip", "-4", "route", "show", "table", "100"}}, {"pod", []string{"ip", "-6", "route", "show", "table", "100"}},
		{"node", []string{save4, "-t", "nat"}}, {"node", []string{save6, "-t", "nat"}},
		{"node", []string{"ipset", "list", rules.IpsetV4}}, {"node", []string{"ipset", "list", rules.IpsetV6}},
	} {
		istioNS, refNS := istio.NetnsPath(), p.NetnsPath()
		if c.where == "node" {
			istioNS, refNS = simnode.NetnsPath(istioNode.NodeNS), simnode.NetnsPath(n.NodeNS)
		}
		istioOut := normalize(reference.Run(t, istioNS, "", c.argv...), istio)
		refOut := normalize(reference.Run(t, refNS, "", c.argv...), p)
		what := c.where + ": " + strings.Join(c.argv, " ")
		if strings.HasSuffix(c.argv[0], "-save") {
			// iptables-legacy-save lists a netns's tables in the order
			// they were first used there, which carries no meaning.
			sortedIstio, sortedRef := tablesInOrder(istioOut), tablesInOrder(refOut)
			if istioOut != refOut && sortedIstio == sortedRef {
				t.Logf("%s: the tables are listed in another order than test/reference's", what)
			}
			istioOut, refOut = sortedIstio, sortedRef
		}
		if c.argv[0] == "ipset" {
			// A known difference, kept visible: istio-cni creates its
			// ipsets over netlink at hash:ip revision 2 (no bucketsize),
			// ipset(8) at the kernel's newest (6 here, bucketsize 12).
			// Members, comments and limits are compared.
			istioHdr, refHdr := ipsetRevision(istioOut), ipsetRevision(refOut)
			if istioHdr != refHdr {
				t.Logf("%s: ipset revision and header differ: istio-cni %q, test/reference %q", what, istioHdr, refHdr)
			}
			istioOut, refOut = withoutRevision(istioOut), withoutRevision(refOut)
		}
		if istioOut != refOut {
			t.Errorf("%s differs:\nistio-cni:\n%s\ntest/reference:\n%s", what, istioOut, refOut)
			continue
		}
		t.Logf("%s: the same %d lines", what, strings.Count(istioOut, "\n")+1)
	}
	return backend
}

var (
	counters   = regexp.MustCompile(`\[\d+:\d+\]`)
	initval    = regexp.MustCompile(` initval 0x[0-9a-f]+`)
	revision   = regexp.MustCompile(`(?m)^Revision: \d+$`)
	bucketsize = regexp.MustCompile(` bucketsize \d+`)
)

// ipsetRevision is what `ipset list` says of the set's kernel revision:
// its revision line and header.
func ipsetRevision(list string) string {
	var out []string
	for _, line := range strings.Split(list, "\n") {
		if strings.HasPrefix(line, "Revision:") || strings.HasPrefix(line, "Header:") {
			out = append(out, line)
		}
	}
	return strings.Join(out, "; ")
}

// withoutRevision drops the revision and the bucket size only that
// revision has from an ipset listing.
func withoutRevision(list string) string {
	return bucketsize.ReplaceAllString(revision.ReplaceAllString(list, "Revision: -"), "")
}

// normalize drops iptables-save's comment lines (times, versions), its
// counters, ipset's memory size and hash seed, and names the pod's
// addresses and uid.
func normalize(out string, p *simnode.Pod) string {
	var keep []string
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.HasPrefix(line, "#") || strings.HasPrefix(line, "Size in memory:") {
			continue
		}
		line = initval.ReplaceAllString(counters.ReplaceAllString(line, "[0:0]"), "")
		line = strings.NewReplacer(p.V4.String(), "<pod v4>", p.V6.String(), "<pod v6>", p.UID, "<pod uid>").Replace(line)
		keep = append(keep, line)
	}
	return strings.Join(keep, "\n")
}

// removed is what a side's users and ztunnel saw when the pod went away.
type removed struct {
	DelErr string
	// Transcript is everything ztunnel received, the add included.
	Transcript []string
	// NodeState says whether state on the node still names the pod: the
	// real agent's probe ipset entry, our agent's pinned pod. It outlives
	// the pod, so it must go.
	NodeState bool
	// InPodRules says whether the real agent's chains are still in the
	// pod's netns. It leaves them on purpose for a deleted pod (its
	// RemovePodFromMesh skips DeleteInpodRules when the pod is deleted:
	// the netns goes with the sandbox); our state in the pod is its
	// pinned entry, so there is nothing to compare.
	InPodRules bool
}

// removePod takes the pod away as kubelet does: the API marks it
// deleted, the runtime tears the sandbox down (CNI DEL), the object goes;
// it waits up to 30 s for ztunnel to be told.
func removePod(t *testing.T, c *kubeapi.Cluster, s *side, p *simnode.Pod, kp *corev1.Pod) removed {
	t.Helper()
	ctx := context.Background()
	pods := c.Client.CoreV1().Pods(kp.Namespace)
	if err := pods.Delete(ctx, kp.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(30))}); err != nil {
		t.Fatal(err)
	}
	var r removed
	if err := s.runtime.Del(p, filepath.Join(s.runtime.NetnsDir, p.NS)); err != nil {
		r.DelErr = err.Error()
	}
	if err := pods.Delete(ctx, kp.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr(int64(0))}); err != nil {
		t.Fatal(err)
	}
	testenv.Poll(30*time.Second, func() bool {
		r.Transcript = transcript(t, s, p)
		return slices.ContainsFunc(r.Transcript, func(m string) bool { return strings.Contains(m, ": del uid=<pod uid>") })
	})
	if s.name == "istio-cni" {
		inPod := reference.Run(t, p.NetnsPath(), "", "iptables-save") + reference.Run(t, p.NetnsPath(), "", "ip6tables-save")
		r.InPodRules = strings.Contains(inPod, "ISTIO_")
	}
	// Polled: the order of the del to ztunnel and the node's cleanup is
	// the agent's.
	testenv.Poll(10*time.Second, func() bool {
		if s.name == "istio-cni" {
			node := simnode.NetnsPath(s.node.NodeNS)
			sets := reference.Run(t, node, "", "ipset", "list", rules.IpsetV4) + reference.Run(t, node, "", "ipset", "list", rules.IpsetV6)
			r.NodeState = strings.Contains(sets, p.UID)
		} else {
			r.NodeState = slices.ContainsFunc(agentrun.PinnedPods(t, s.node.BPFFSDir), func(e inspect.EnrolledPod) bool { return e.UID == p.UID })
		}
		return !r.NodeState
	})
	return r
}

func ptr[T any](v T) *T { return &v }

// tablesInOrder returns an iptables-save dump (comments dropped) with its
// tables (each from its "*name" line to its COMMIT) sorted by name.
func tablesInOrder(dump string) string {
	var tables []string
	var cur []string
	for _, line := range strings.Split(dump, "\n") {
		cur = append(cur, line)
		if line == "COMMIT" {
			tables = append(tables, strings.Join(cur, "\n"))
			cur = nil
		}
	}
	slices.Sort(tables)
	return strings.Join(append(tables, cur...), "\n")
}

// The same pod, then removed as kubelet removes it: the CNI DEL's exit
// (istio-cni's DEL does nothing; removal follows the API), what ztunnel
// received (the add, then a del of the pod's uid) and that no state on
// the node names the pod any more are the same.
func TestOnePodRemovedBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	c := requireCluster(t)
	got := map[string]removed{}
	eachSide(t, c, func(s *side, nodeName string) {
		p, kp := addEnabledPod(t, c, s, nodeName)
		r := removePod(t, c, s, p, kp)
		t.Logf("%s after removal:\n  DEL error %q\n  node state names the pod %t\n  in-pod rules left %t\n  ztunnel received:\n    %s",
			s.name, r.DelErr, r.NodeState, r.InPodRules, strings.Join(r.Transcript, "\n    "))
		got[s.name] = r
	})
	istio, ours := got["istio-cni"], got["ambient-ebpf"]
	if istio.DelErr != ours.DelErr || istio.NodeState || ours.NodeState {
		t.Errorf("after removal: istio-cni DEL error %q, node state names the pod %t; ambient-ebpf DEL error %q, node state names the pod %t",
			istio.DelErr, istio.NodeState, ours.DelErr, ours.NodeState)
	}
	if istio.InPodRules {
		t.Log("a known difference: istio-cni leaves its in-pod rules in a deleted pod's netns (which goes with the sandbox); ambient-ebpf's pod state is on the node and is gone")
	}
	if !slices.Equal(istio.Transcript, ours.Transcript) {
		t.Errorf("ztunnel received different messages:\nistio-cni:\n  %s\nambient-ebpf:\n  %s",
			strings.Join(istio.Transcript, "\n  "), strings.Join(ours.Transcript, "\n  "))
	}
}
