// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	mdnetlink "github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The agent's flags of the takeover and the hand-back.
var (
	takeoverFlags = []string{"--istio-cni-takeover=true"}
	handbackFlags = []string{"--uninstall-on-exit", "--istio-cni-handback=" + string(istiocni.NftCompat)}
)

// waitTakenOver waits until every pod given is enrolled in eBPF and free
// of istio-cni's rules, failing at once if the agent exits.
func (s *scenario) waitTakenOver(t *testing.T, pods ...*tpod) {
	t.Helper()
	var names []string
	for _, p := range pods {
		names = append(names, p.Name)
	}
	done := testenv.Poll(2*time.Minute, func() bool {
		if s.Agent.Exited() {
			t.Fatalf("the agent exited during the takeover:\n%s", s.Agent.Output.String())
		}
		for _, p := range pods {
			if !s.takenOver(t, p.Pod) {
				return false
			}
		}
		return true
	})
	if !done {
		for _, p := range pods {
			r := istiocniPod(t, p.Pod)
			t.Logf("%s: pinned %v, istio-cni's rules in %v (Equivalent %v %q)", p.Name, s.pinned(t, p.Pod), r.Backends(), r.Equivalent, r.Reasons)
		}
		t.Fatalf("timed out waiting for the takeover of %s; agent:\n%s", strings.Join(names, ", "), s.Agent.Output.String())
	}
}

// takeOver starts the agent with the takeover on (takeoverFlags, or
// flags) and waits until it took every pod over; then, after more
// samples, checks that neither the pods nor the node hold anything of
// istio-cni's.
func (s *scenario) takeOver(t *testing.T, sm *sampler, flags ...string) {
	t.Helper()
	if len(flags) == 0 {
		flags = takeoverFlags
	}
	s.StartReadyAgent(t, flags...)
	s.WaitZtunnel(t)
	s.waitTakenOver(t, s.pods...)
	sm.waitSamples(t, 100)
	for _, p := range s.pods {
		checkNoIstioCNI(t, p.NetnsPath())
	}
	s.checkNodeFreeOfIstioCNI(t)
}

// waitDrained waits until the agent removed its drain table from every
// pod given. On a timeout it shows what held the drain: the pod's
// conntrack entries and the agent's output.
func (s *scenario) waitDrained(t *testing.T, pods ...*tpod) {
	t.Helper()
	for _, p := range pods {
		if !testenv.Poll(time.Minute, func() bool {
			has, err := istiocni.HasDrain(context.Background(), p.NetnsPath())
			return err == nil && !has
		}) {
			t.Fatalf("timed out waiting for the drain table of %s to go; its conntrack entries:\n%s\nthe agent:\n%s", p.Name, conntrackDump(p.NetnsPath(), nil), s.Agent.Output.String())
		}
	}
}

// withConntrack runs f on a conntrack netlink socket in the netns at path.
func withConntrack(path string, f func(*conntrack.Conn) error) error {
	ns, err := os.Open(path)
	if err != nil {
		return err
	}
	defer ns.Close()
	c, err := conntrack.Dial(&mdnetlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		return fmt.Errorf("conntrack netlink in %s: %w", path, err)
	}
	defer c.Close()
	return f(c)
}

// remappedPeer says which client address the far end saw for the TCP
// connection from local to dst when the pod's NAT changed its source port.
// istio-cni's REDIRECT sends every outbound connection of the pod to the
// one port 15001 (and every inbound one to 15006), so a new connection
// whose redirected tuple equals a live one's (same client port, another
// original destination) gets a new source port from conntrack, as on any
// node running istio-cni; the stand-in then records that port.
func remappedPeer(netns string, local, dst netip.AddrPort) (netip.AddrPort, bool) {
	var got conntrack.Flow
	err := withConntrack(netns, func(c *conntrack.Conn) (err error) {
		got, err = c.Get(conntrack.Flow{TupleOrig: conntrack.Tuple{
			IP:    conntrack.IPTuple{SourceAddress: local.Addr().Unmap(), DestinationAddress: dst.Addr().Unmap()},
			Proto: conntrack.ProtoTuple{Protocol: unix.IPPROTO_TCP, SourcePort: local.Port(), DestinationPort: dst.Port()},
		}})
		return err
	})
	if err != nil {
		return netip.AddrPort{}, false
	}
	peer := netip.AddrPortFrom(got.TupleReply.IP.DestinationAddress, got.TupleReply.Proto.DestinationPort)
	return peer, peer.Port() != local.Port()
}

// conntrackDump lists the conntrack entries of the netns at path that keep
// says to (all with nil), one per line, for a failure's message.
func conntrackDump(path string, keep func(conntrack.Flow) bool) string {
	var flows []conntrack.Flow
	err := withConntrack(path, func(c *conntrack.Conn) (err error) {
		flows, err = c.Dump(nil)
		return err
	})
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, f := range flows {
		if keep != nil && !keep(f) {
			continue
		}
		state := ""
		if f.ProtoInfo.TCP != nil {
			state = fmt.Sprintf(" tcp-state=%d", f.ProtoInfo.TCP.State)
		}
		fmt.Fprintf(&b, "proto=%d orig %s:%d->%s:%d reply %s:%d->%s:%d status=%#x mark=%#x timeout=%ds%s\n",
			f.TupleOrig.Proto.Protocol,
			f.TupleOrig.IP.SourceAddress, f.TupleOrig.Proto.SourcePort, f.TupleOrig.IP.DestinationAddress, f.TupleOrig.Proto.DestinationPort,
			f.TupleReply.IP.SourceAddress, f.TupleReply.Proto.SourcePort, f.TupleReply.IP.DestinationAddress, f.TupleReply.Proto.DestinationPort,
			uint32(f.Status), f.Mark, f.Timeout, state)
	}
	return b.String()
}

func hasDrain(t *testing.T, p *tpod) bool {
	t.Helper()
	has, err := istiocni.HasDrain(context.Background(), p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	return has
}

// unrelatedRules snapshots everybody else's rules: the node's and each
// pod's, istio-cni's and ours left out.
func (s *scenario) unrelatedRules(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{"node": rulesSnapshot(t, simnode.NetnsPath(s.NodeNS), false)}
	for _, p := range s.pods {
		out[p.Name] = rulesSnapshot(t, p.NetnsPath(), false)
	}
	return out
}

func (s *scenario) checkUnrelated(t *testing.T, phase string, before map[string]string) {
	t.Helper()
	for where, now := range s.unrelatedRules(t) {
		if now != before[where] {
			t.Errorf("%s: the unrelated rules of %s changed:\n got: %s\nwant: %s", phase, where, now, before[where])
		}
	}
}

// The acceptance: a node redirected by istio-cni (pods with its
// rules in the legacy and the nft backend, the node's probe rule in
// legacy, someone else's rules in the node and a pod) is taken over by the
// agent with live streams both ways and both families and a sampler of new
// connections running throughout; then handed back on uninstall, with
// streams opened under eBPF and, in one pod, streams istio-cni redirected
// before the takeover (under the agent's drain until then). No stream
// breaks, no sampled connection goes unredirected, istio-cni's rules are
// gone after the takeover and exactly back after the hand-back, nothing of
// ours is left, and the unrelated rules never change.
func TestTakeoverAndHandBack(t *testing.T) {
	s := newScenario(t,
		podSpec{name: "legacy", backend: reference.Legacy},
		podSpec{name: "nft", backend: reference.NftCompat, unrelated: true})
	unrelated := s.unrelatedRules(t)
	st := startStreams(t)
	s.openStreams(st, "pre")
	sm := s.startSampler(t)
	sm.waitSamples(t, 50)
	sm.check(t, "under istio-cni")

	s.handOverZDS()
	s.takeOver(t, sm)
	for _, p := range s.pods {
		// The streams istio-cni redirected still run: the drain holds
		// their conntrack entries.
		if !hasDrain(t, p) {
			t.Errorf("%s: no drain table while istio-cni's connections are open", p.Name)
		}
	}
	s.checkUnrelated(t, "after the takeover", unrelated)
	st.check("pre-")
	sm.check(t, "across the takeover")
	logStatus(t, s)

	// The old connections of one pod end; so does its drain. The other
	// pod's live on across the hand-back, under its drain.
	legacy, nft := s.pods[0], s.pods[1]
	st.closeStreams("pre-out-legacy", "pre-in-legacy")
	s.waitDrained(t, legacy)
	if !hasDrain(t, nft) {
		t.Errorf("%s: the drain table went while istio-cni's connections are open", nft.Name)
	}
	s.openStreams(st, "mid") // under eBPF, to live across the hand-back
	sm.waitSamples(t, 50)

	// Hand-back: the agent restarted with the uninstall flags, then
	// stopped.
	if !s.Agent.Terminate(10 * time.Second) {
		t.Errorf("the agent did not stop on SIGTERM:\n%s", s.Agent.Output.String())
	}
	sm.waitSamples(t, 20) // no agent at all
	s.StartReadyAgent(t, handbackFlags...)
	s.WaitZtunnel(t)
	sm.waitSamples(t, 50)
	// Generous: under emulation (hack/vmtest, Debian's 6.1) handing one
	// pod back took 43 s, most of it iptables-nft-restore.
	if !s.Agent.Terminate(3 * time.Minute) {
		t.Errorf("the agent did not hand back and exit cleanly:\n%s", s.Agent.Output.String())
	}
	sm.waitSamples(t, 100)
	for _, p := range s.pods {
		r := istiocniPod(t, p.Pod)
		if !r.Equivalent || !slices.Equal(r.Backends(), []istiocni.Backend{istiocni.NftCompat}) {
			t.Errorf("%s after the hand-back: istio-cni's rules in %v, Equivalent %v (%q)", p.Name, r.Backends(), r.Equivalent, r.Reasons)
		}
		if hasDrain(t, p) {
			t.Errorf("%s: the drain table is left after the hand-back", p.Name)
		}
		checkNoPrograms(t, s, p.Pod)
	}
	s.checkNodeHandedBack(t)
	if _, err := os.Stat(s.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("pins left after the hand-back: %v", err)
	}
	s.checkUnrelated(t, "after the hand-back", unrelated)
	st.check("mid-", "pre-out-nft", "pre-in-nft")
	sm.check(t, "across the hand-back")
	if t.Failed() {
		t.Logf("the hand-back agent's output:\n%s", s.Agent.Output.String())
	}
}

// checkNodeHandedBack asserts istio-cni's host state is back on the node:
// its exact probe rule (in iptables-nft, both families) and its ipsets
// holding every pod's addresses.
func (s *scenario) checkNodeHandedBack(t *testing.T) {
	t.Helper()
	node, err := istiocni.New().InspectNode(context.Background(), simnode.NetnsPath(s.NodeNS))
	if err != nil {
		t.Fatal(err)
	}
	exact := 0
	for _, r := range node.Iptables {
		if r.Backend == istiocni.NftCompat && r.Exact {
			exact++
		}
	}
	if exact != 2 || node.Entries() != 2*len(s.pods) {
		t.Errorf("the node after the hand-back: %+v", node)
	}
	sets := reference.Run(t, simnode.NetnsPath(s.NodeNS), "", "ipset", "list")
	for _, p := range s.pods {
		for _, ip := range p.IPs() {
			if !strings.Contains(sets, ip.String()+` comment "`+p.UID+`"`) {
				t.Errorf("the probe ipsets lack %s of %s:\n%s", ip, p.Name, sets)
			}
		}
	}
}

// checkNoPrograms asserts no BPF program is attached to the pod's
// interfaces (TCX or tc filters), its host veth, or the node's cgroup.
func checkNoPrograms(t *testing.T, s *scenario, p *simnode.Pod) {
	t.Helper()
	for _, at := range []struct{ ns, iface string }{{p.NS, "eth0"}, {p.NS, "lo"}, {s.NodeNS, p.HostVeth}} {
		if err := simnode.InNetns(at.ns, func() error {
			l, err := netlink.LinkByName(at.iface)
			if err != nil {
				return fmt.Errorf("%s: %w", at.iface, err)
			}
			for _, attach := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
				res, err := link.QueryPrograms(link.QueryOptions{Target: l.Attrs().Index, Attach: attach})
				if errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EINVAL) {
					continue // no TCX on this kernel
				}
				if err != nil {
					return fmt.Errorf("%s: query %s: %w", at.iface, attach, err)
				}
				if len(res.Programs) > 0 {
					t.Errorf("%s %s: %d %s programs left", at.ns, at.iface, len(res.Programs), attach)
				}
			}
			for _, parent := range []uint32{netlink.HANDLE_MIN_INGRESS, netlink.HANDLE_MIN_EGRESS} {
				fs, err := netlink.FilterList(l, parent)
				if err != nil {
					continue // no clsact qdisc
				}
				if len(fs) > 0 {
					t.Errorf("%s %s: %d tc filters left", at.ns, at.iface, len(fs))
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	cg, err := os.Open(s.CgroupRoot)
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	for _, attach := range []ebpf.AttachType{ebpf.AttachCGroupInet4Connect, ebpf.AttachCGroupInet6Connect, ebpf.AttachCGroupSockOps, ebpf.AttachCGroupGetsockopt} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(cg.Fd()), Attach: attach})
		if err != nil {
			t.Fatalf("query %s on %s: %v", attach, s.CgroupRoot, err)
		}
		if len(res.Programs) > 0 {
			t.Errorf("%s: %d %s programs left", s.CgroupRoot, len(res.Programs), attach)
		}
	}
}

// logStatus logs what the agent says of the takeover (status and
// metrics); their form is not settled, so nothing is asserted on them.
func logStatus(t *testing.T, s *scenario) {
	t.Helper()
	_, metrics := s.Get("/metrics")
	for _, line := range strings.Split(metrics, "\n") {
		if strings.Contains(line, "istio_cni_takeover") {
			t.Log(line)
		}
	}
}

// A pod whose istio-cni rules were edited by hand (one rule changed) is
// not taken over: the agent leaves it on iptables, untouched (its rules,
// policy rules and routes identical after), still redirected; its
// addresses stay in the probe ipsets and the node's probe rule stays for
// it, while the other pod is taken over as usual.
func TestTakeoverLeavesAHandEditedPodOnIptables(t *testing.T) {
	s := newScenario(t,
		podSpec{name: "good", backend: reference.NftCompat},
		podSpec{name: "edited", backend: reference.Legacy, unrelated: true, edit: editOneRule(reference.Legacy)})
	good, edited := s.pods[0], s.pods[1]
	before := podSnapshot(t, edited.NetnsPath())
	unrelated := s.unrelatedRules(t)
	st := startStreams(t)
	s.openStreams(st, "pre")
	sm := s.startSampler(t)
	sm.waitSamples(t, 50)

	s.handOverZDS()
	s.StartReadyAgent(t, takeoverFlags...)
	s.WaitZtunnel(t)
	s.waitTakenOver(t, good)
	sm.waitSamples(t, 200) // time for the agent to get to the other pod too
	checkNoIstioCNI(t, good.NetnsPath())
	if got := podSnapshot(t, edited.NetnsPath()); got != before {
		t.Errorf("the hand-edited pod was touched:\n got: %s\nwant: %s", got, before)
	}
	if s.pinned(t, edited.Pod) {
		t.Error("the hand-edited pod was enrolled in eBPF")
	}
	if hasDrain(t, edited) {
		t.Error("the hand-edited pod got a drain table")
	}
	sets := reference.Run(t, simnode.NetnsPath(s.NodeNS), "", "ipset", "list")
	for _, ip := range edited.IPs() {
		if !strings.Contains(sets, ip.String()+` comment "`+edited.UID+`"`) {
			t.Errorf("the probe ipsets lost %s of the hand-edited pod:\n%s", ip, sets)
		}
	}
	for _, ip := range good.IPs() {
		if strings.Contains(sets, ip.String()+" ") {
			t.Errorf("the probe ipsets still hold %s of the pod taken over:\n%s", ip, sets)
		}
	}
	node, err := istiocni.New().InspectNode(context.Background(), simnode.NetnsPath(s.NodeNS))
	if err != nil {
		t.Fatal(err)
	}
	if len(node.Iptables) != 2 {
		t.Errorf("the node's probe rule, still needed by the hand-edited pod: %+v", node.Iptables)
	}
	s.checkUnrelated(t, "after the takeover", unrelated)
	st.check("pre-in-good", "pre-out-good", "pre-in-edited", "pre-out-edited")
	sm.check(t, "across the takeover")
	logStatus(t, s)
	if out := s.Agent.Output.String(); !strings.Contains(out, edited.Name) {
		t.Errorf("the agent's log does not name the pod it left on iptables:\n%s", out)
	}
}
