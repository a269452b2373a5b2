// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/upgrade"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

const agentPkg = "github.com/ambient-ebpf/ambient-ebpf/cmd/ambient-ebpf-agent"

// build is one agent binary an upgrade test runs.
type build struct {
	name   string // for messages: "v0.1.0", "HEAD", "HEAD next layout"
	bin    string
	layout int // the pinned layout it writes
	// recorded: it writes the layout record (v0.1.0 predates it).
	recorded bool
	// grpcCNI: it serves the CNI channel as gRPC (v0.1.0 predates
	// pkg/api/cniv1's frames).
	grpcCNI bool
	// args are the agent's flags besides the harness's.
	args []string
}

// releaseBuild is the agent of the last release of hack/releases, built
// at its commit (internal/testbin caches it by commit).
func releaseBuild(t *testing.T) build {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := testbin.Root(wd)
	if os.Getenv(testbin.PrebuiltEnv) != "" {
		root, err = wd, nil
	}
	if err != nil {
		t.Fatal(err)
	}
	rel, err := testbin.Last(root)
	if err != nil {
		t.Fatal(err)
	}
	bin, err := testbin.Build(root, rel, agentPkg)
	if err != nil {
		t.Fatal(err)
	}
	// v0.1.0 is layout 1 and writes no record; a later release writes one.
	return build{name: rel.Version, bin: bin, layout: 1, recorded: rel.Version != "v0.1.0", grpcCNI: rel.Version == "v0.1.0"}
}

func headBuild(n *agentNode) build {
	return build{name: "HEAD", bin: n.Bin, layout: upgrade.BuildLayout(), recorded: true}
}

// nextBuild is HEAD with the test-only next layout (build tag
// ae_layout_next: a field more in ae_pods' value).
func nextBuild(t *testing.T, n *agentNode) build {
	t.Helper()
	return build{name: "HEAD next layout", bin: simnode.BuildBinary(t, n.Dir, agentPkg, "ae_layout_next"),
		layout: upgrade.BuildLayout() + 1, recorded: true}
}

// Upgrade from the last release to HEAD, and back: pods enrolled by one
// agent, with a live redirected stream and new connections (outbound and
// inbound) all along, keep every redirection while the agent is replaced
// by the other build; afterwards the pods are enrolled with the new
// build's programs on every hook, no program or map of the old one is
// left, and a pod enrolled after the switch is redirected too.
func TestUpgradeFromTheLastRelease(t *testing.T) {
	n := newAgentNode(t, "a", "b", "c")
	release, head := releaseBuild(t), headBuild(n)
	n.replaceAgent(t, []build{release, head})
}

// v0.1.0 attaches every socket program to the cgroup root and refuses
// links elsewhere: as the README says, HEAD runs with --pods-cgroup=none
// (and the SNAT host probes v0.1.0 knows) before the rollback.
func TestDowngradeToTheLastRelease(t *testing.T) {
	n := newAgentNode(t, "a", "b", "c")
	release, head := releaseBuild(t), headBuild(n)
	if release.name == "v0.1.0" {
		head.args = []string{"--pods-cgroup=none", "--host-probes=snat"}
	}
	n.replaceAgent(t, []build{head, release})
}

// A real layout change (ae_pods' value grows a field) migrates both ways
// with the same guarantees: HEAD to the next layout and back.
func TestMigrateToTheNextLayoutAndBack(t *testing.T) {
	n := newAgentNode(t, "a", "b", "c")
	head := headBuild(n)
	n.replaceAgent(t, []build{head, nextBuild(t, n), head})
}

// The agent is killed (its own failpoint, SIGKILL) at each step of a
// migration to the next layout. Redirection holds while no agent runs,
// and the next start, of the new build or of the old one (a rollout
// rolled back), finishes the migration to its own layout.
func TestAgentKilledDuringAMigrationFinishesIt(t *testing.T) {
	for _, step := range upgrade.Steps {
		for _, rollback := range []bool{false, true} {
			name := step
			if rollback {
				name += "/rollback"
			}
			t.Run(name, func(t *testing.T) {
				n := newAgentNode(t, "a", "b", "c")
				head, next := headBuild(n), nextBuild(t, n)
				then := next
				if rollback {
					then = head
				}
				n.replaceAgent(t, []build{head, next, then}, step)
			})
		}
	}
}

// replaceAgent runs builds[0] with pods a and b enrolled, then replaces
// it with each following build in turn while traffic runs. With crashAt,
// the second build is killed at that migration step and the third one
// starts on what it left.
func (n *agentNode) replaceAgent(t *testing.T, builds []build, crashAt ...string) {
	t.Helper()
	a, b, c := n.pods["a"], n.pods["b"], n.pods["c"]
	zt := n.StartZtunnelFor(n.ZDS)
	n.Bin, n.grpcCNI = builds[0].bin, builds[0].grpcCNI
	n.startConnectedAgent(t, builds[0].args...)
	for _, p := range []*simnode.Pod{a, b} {
		if resp, err := n.podAdd(t, p); err != nil || !resp.GetEnrolled() {
			t.Fatalf("ADD %s with %s: %+v, %v\n%s", p.Name, builds[0].name, resp, err, n.Agent.Output.String())
		}
	}
	n.checkBuild(t, builds[0], []*simnode.Pod{a, b}, nil)
	traffic := n.startTraffic(t, zt, a, b)

	for i, next := range builds[1:] {
		before := n.attachedPrograms(t)
		if crashed := n.Agent.Exited(); !crashed && !n.Agent.Terminate(10*time.Second) {
			t.Errorf("%s did not stop on SIGTERM:\n%s", builds[i].name, n.Agent.Output.String())
		}
		time.Sleep(200 * time.Millisecond) // no agent at all
		if i == 0 && len(crashAt) > 0 {
			n.Bin, n.grpcCNI = next.bin, next.grpcCNI
			n.crashAgent(t, crashAt[0])
			time.Sleep(200 * time.Millisecond)
			continue
		}
		n.Bin, n.grpcCNI = next.bin, next.grpcCNI
		n.startConnectedAgent(t, next.args...)
		time.Sleep(300 * time.Millisecond)
		n.checkBuild(t, next, []*simnode.Pod{a, b}, before)
		if prev := builds[i]; prev.layout != next.layout || len(crashAt) > 0 {
			if out := n.Agent.Output.String(); !strings.Contains(out, "migrated the pinned data path") {
				t.Errorf("%s did not migrate the pins of %s:\n%s", next.name, prev.name, out)
			}
		}
	}
	traffic.check(t)

	last := builds[len(builds)-1]
	// A pod enrolled after the upgrade is redirected by the new build.
	if resp, err := n.podAdd(t, c); err != nil || !resp.GetEnrolled() {
		t.Fatalf("ADD %s with %s: %+v, %v", c.Name, last.name, resp, err)
	}
	more := n.startTraffic(t, zt, c)
	time.Sleep(300 * time.Millisecond)
	more.check(t)
	n.checkBuild(t, last, []*simnode.Pod{a, b, c}, nil)
	for _, p := range []*simnode.Pod{a, b, c} {
		n.podDel(t, p)
		n.checkUntouched(t, p)
	}
	n.Agent.Terminate(10 * time.Second)
}

// crashAgent starts n.Bin with a failpoint at step and waits for it to
// die there.
func (n *agentNode) crashAgent(t *testing.T, step string) {
	t.Helper()
	t.Setenv(agent.FailpointEnv, step)
	n.StartAgent(t)
	t.Setenv(agent.FailpointEnv, "")
	// Generous: under emulation (hack/vmtest) a migration's steps take
	// seconds each; 20 s was too little for upgrade/switched on 5.10 and
	// 6.1.
	if !testenv.Poll(2*time.Minute, n.Agent.Exited) {
		n.Agent.Kill()
		t.Fatalf("the agent did not reach %s:\n%s", step, n.Agent.Output.String())
	}
	if !strings.Contains(n.Agent.Output.String(), "migrating the pinned data path") {
		t.Fatalf("the agent did not migrate:\n%s", n.Agent.Output.String())
	}
}

// checkBuild checks that the running agent of b holds pods, every one on
// b's programs: the layout record names b, the journal the pods, every
// pinned link and program is not one of before (the previous build's)
// and uses only maps pinned under maps/, and the cgroup root runs
// nothing but the pinned links' programs.
func (n *agentNode) checkBuild(t *testing.T, b build, pods []*simnode.Pod, before map[ebpf.ProgramID][]mapRef) {
	t.Helper()
	if b.recorded {
		l, err := upgrade.ReadLayout(n.BPFFSDir)
		if err != nil {
			t.Fatal(err)
		}
		if l.Layout != b.layout || l.Upgrading || !l.Recorded {
			t.Errorf("after %s: layout record %+v, want layout %d, stable", b.name, l, b.layout)
		}
	}
	_, metrics := n.Get("/metrics")
	if want := fmt.Sprintf("\nambient_ebpf_enrolled_pods %d\n", len(pods)); !strings.Contains(metrics, want) {
		t.Errorf("after %s: metrics lack %q", b.name, strings.TrimSpace(want))
	}
	for _, p := range pods {
		if _, err := os.Stat(filepath.Join(n.BPFFSDir, "pods", p.UID)); err != nil {
			t.Errorf("after %s: %s has no pins: %v", b.name, p.Name, err)
		}
	}
	if b.layout == upgrade.BuildLayout() {
		if got := agentrun.PinnedPods(t, n.BPFFSDir); len(got) != len(pods) {
			t.Errorf("after %s: the journal holds %+v, want %d pods", b.name, got, len(pods))
		}
	}
	if _, err := os.Stat(filepath.Join(n.BPFFSDir, "next")); !os.IsNotExist(err) {
		t.Errorf("after %s: staged maps left: %v", b.name, err)
	}
	progs := n.attachedPrograms(t)
	if len(progs) == 0 {
		t.Fatalf("after %s: no pinned programs", b.name)
	}
	pinned := n.pinnedMaps(t)
	for id, prog := range progs {
		if _, old := before[id]; old {
			t.Errorf("after %s: program %d of the previous build still pinned", b.name, id)
		}
		for _, m := range prog {
			if !pinned[m.id] && !internalMap(m.name) && !bpfobj.UnpinnedMap(m.name) {
				t.Errorf("after %s: program %d uses map %d (%s), which is not pinned under maps/: the previous build's", b.name, id, m.id, m.name)
			}
		}
	}
	// Each hook runs one program of ours for a pod's socket: on the root,
	// or on the pods' cgroup with the node-wide half (links/node_<hook>)
	// on the root.
	for hook, attach := range map[string]ebpf.AttachType{"connect4": ebpf.AttachCGroupInet4Connect, "connect6": ebpf.AttachCGroupInet6Connect,
		"sockops": ebpf.AttachCGroupSockOps, "getsockopt": ebpf.AttachCGroupGetsockopt} {
		want := 1
		if _, err := os.Stat(filepath.Join(n.BPFFSDir, "links", bpfobj.NodeScopePrefix+hook)); err == nil {
			want = 2
		}
		var found []link.AttachedProgram
		for _, cg := range []string{n.CgroupRoot, n.PodsCgroup} {
			res, err := link.QueryPrograms(link.QueryOptions{Target: cgroupFD(t, cg), Attach: attach})
			if err != nil {
				t.Fatalf("query %s of %s: %v", attach, cg, err)
			}
			found = append(found, res.Programs...)
		}
		if len(found) != want {
			t.Errorf("after %s: %d programs on %s of the cgroup root and the pods' cgroup, want %d", b.name, len(found), attach, want)
		}
		for _, p := range found {
			if _, ok := progs[p.ID]; !ok {
				t.Errorf("after %s: program %d on %s is no pinned link's", b.name, p.ID, attach)
			}
		}
	}
}

func cgroupFD(t *testing.T, dir string) int {
	t.Helper()
	f, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return int(f.Fd())
}

type mapRef struct {
	id   ebpf.MapID
	name string
}

// attachedPrograms returns every program pinned under links/ and pods/
// (as a link's program or a tc filter's pinned program) with the maps it
// uses.
func (n *agentNode) attachedPrograms(t *testing.T) map[ebpf.ProgramID][]mapRef {
	t.Helper()
	out := map[ebpf.ProgramID][]mapRef{}
	add := func(prog *ebpf.Program) {
		info, err := prog.Info()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		ids, _ := info.MapIDs()
		var refs []mapRef
		for _, mid := range ids {
			m, err := ebpf.NewMapFromID(mid)
			if err != nil {
				continue
			}
			mi, err := m.Info()
			m.Close()
			if err == nil {
				refs = append(refs, mapRef{mid, mi.Name})
			}
		}
		out[id] = refs
	}
	_ = filepath.WalkDir(n.BPFFSDir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(n.BPFFSDir, path)
		if !strings.HasPrefix(rel, "links/") && !strings.HasPrefix(rel, "pods/") {
			return nil
		}
		if l, err := link.LoadPinnedLink(path, nil); err == nil {
			defer l.Close()
			info, err := l.Info()
			if err != nil {
				t.Fatal(err)
			}
			prog, err := ebpf.NewProgramFromID(info.Program)
			if err != nil {
				t.Fatal(err)
			}
			defer prog.Close()
			add(prog)
			return nil
		}
		prog, err := ebpf.LoadPinnedProgram(path, nil)
		if err != nil {
			t.Errorf("pin %s is neither a link nor a program: %v", rel, err)
			return nil
		}
		defer prog.Close()
		add(prog)
		return nil
	})
	return out
}

// pinnedMaps returns the ids of the maps pinned under maps/.
func (n *agentNode) pinnedMaps(t *testing.T) map[ebpf.MapID]bool {
	t.Helper()
	out := map[ebpf.MapID]bool{}
	entries, err := os.ReadDir(filepath.Join(n.BPFFSDir, "maps"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		m, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", e.Name()), nil)
		if err != nil {
			t.Fatal(err)
		}
		info, err := m.Info()
		m.Close()
		if err != nil {
			t.Fatal(err)
		}
		id, _ := info.ID()
		out[id] = true
	}
	return out
}

// internalMap: a program's own data sections (.rodata, .data, .bss), not
// pinned.
func internalMap(name string) bool { return strings.Contains(name, ".") }

// traffic keeps redirected connections going from pods and to them.
type traffic struct {
	out     []*simnode.TrafficProbe
	stop    atomic.Bool
	wg      sync.WaitGroup
	mu      sync.Mutex
	inbound int
	fails   []string
}

// startTraffic starts, for each pod, an outbound probe (a stream that must
// not break, new connections that must reach ztunnel's outbound listener)
// and new inbound connections from outside that must reach its inbound one.
func (n *agentNode) startTraffic(t *testing.T, zt *simnode.Ztunnel, pods ...*simnode.Pod) *traffic {
	t.Helper()
	tr := &traffic{}
	outside := n.StartOutsideApp()
	for i, p := range pods {
		port := uint16(8080 + 10*i)
		outside.Listen("tcp", "outside", netip.AddrPortFrom(netip.IPv6Unspecified(), port))
		if _, err := outside.Do(simnode.AppRequest{Op: "listen-echo", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), port+1)}); err != nil {
			t.Fatal(err)
		}
		app := n.StartApp(p)
		app.Listen("tcp", p.Name, netip.AddrPortFrom(netip.IPv6Unspecified(), 9000))
		probe, err := simnode.StartTrafficProbe(app, zt, netip.AddrPortFrom(simnode.OutsideV4, port+1), netip.AddrPortFrom(simnode.OutsideV4, port))
		if err != nil {
			t.Fatal(err)
		}
		tr.out = append(tr.out, probe)
		dst := netip.AddrPortFrom(p.V4, 9000)
		tr.wg.Add(1)
		go func() {
			defer tr.wg.Done()
			for j := 0; !tr.stop.Load(); j++ {
				seen := len(zt.Records())
				resp, err := outside.Dial("tcp", simnode.AppRequest{Addr: dst})
				var fail string
				switch {
				case err != nil:
					fail = fmt.Sprintf("inbound connection %d to %s: %v", j, p.Name, err)
				case !inboundRecorded(zt, seen, resp.Local, dst):
					fail = fmt.Sprintf("inbound connection %d from %s to %s bypassed ztunnel", j, resp.Local, p.Name)
				}
				tr.mu.Lock()
				tr.inbound++
				if fail != "" {
					tr.fails = append(tr.fails, fail)
				}
				tr.mu.Unlock()
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	return tr
}

// check stops the traffic, once each probe has made a few connections
// since it started, and reports what failed.
func (tr *traffic) check(t *testing.T) {
	t.Helper()
	const enough = 5
	testenv.Eventually(t, time.Minute, "connections", func() bool {
		tr.mu.Lock()
		in := tr.inbound
		tr.mu.Unlock()
		ok := in >= enough*len(tr.out)
		for _, p := range tr.out {
			ok = ok && p.Conns() >= enough
		}
		return ok
	})
	tr.stop.Store(true)
	tr.wg.Wait()
	for _, p := range tr.out {
		conns, failures := p.Stop()
		if len(failures) > 0 {
			t.Errorf("%d outbound failures (of %d connections), first: %v", len(failures), conns, failures[:min(5, len(failures))])
		}
		if conns < enough {
			t.Errorf("only %d outbound connections were tried", conns)
		}
	}
	if len(tr.fails) > 0 {
		t.Errorf("%d inbound failures (of %d connections), first: %v", len(tr.fails), tr.inbound, tr.fails[:min(5, len(tr.fails))])
	}
	if tr.inbound < enough {
		t.Errorf("only %d inbound connections were made", tr.inbound)
	}
}

// inboundRecorded reports whether ztunnel's inbound listener recorded the
// connection from peer to dst after its first seen records (client ports
// are reused for other destinations, so older records do not count).
func inboundRecorded(zt *simnode.Ztunnel, seen int, peer, dst netip.AddrPort) bool {
	return testenv.Poll(100*time.Millisecond, func() bool {
		recs := zt.Records()
		for _, r := range recs[min(seen, len(recs)):] {
			if r.Peer == peer && r.Listener == standin.InboundPort && r.OrigDst == dst {
				return true
			}
		}
		return false
	})
}
