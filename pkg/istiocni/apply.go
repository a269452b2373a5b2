// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"time"

	mdnetlink "github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// The hand-back: giving a pod back to istio-cni while eBPF still
// redirects it. Its connections were established without conntrack in the
// pod (nothing there used it), so once istio-cni's rules turn conntrack on
// a mid-stream segment is picked up as a NEW flow (nf_conntrack_tcp_loose=1,
// the default) and nat PREROUTING REDIRECTs it to ztunnel's :15006, which
// resets it. An ESTABLISHED, un-NATed conntrack entry made beforehand is
// looked up instead, and the segment reaches its socket. So ApplyPod holds
// conntrack with the drain, gives every established socket of the pod an
// entry, applies the rules, and only then removes the drain.

// establishedTimeout is the lifetime of the conntrack entries ApplyPod
// creates: conntrack's default for an established TCP flow (5 days); the
// flow's own segments refresh it from then on.
const establishedTimeout = 432000

// tcpConntrackEstablished is TCP_CONNTRACK_ESTABLISHED (enum tcp_conntrack).
const tcpConntrackEstablished = 3

// Socket states (include/net/tcp_states.h) of a connection that still
// carries segments both ways or is closing, and of a listener.
const (
	tcpEstablished = 1
	tcpFinWait1    = 4
	tcpFinWait2    = 5
	tcpCloseWait   = 8
	tcpLastAck     = 9
	tcpListen      = 10
	tcpClosing     = 11
)

// ApplyPod writes, in the pod netns at path, exactly istio-cni's in-pod
// state for o in backend b: for iptables-legacy and iptables-nft
// RenderInpod of both families through that backend's iptables-restore
// --noflush, for nftables RenderNft (with its ip6 rules) through nft -f;
// and its return path (the policy rule and table 100's local routes, both
// families; those the eBPF enrolment installed are kept as they are).
//
// Every connection already established in the pod survives the rules:
// ApplyPod installs the drain (conntrack then sees every new connection
// from its SYN), creates an ESTABLISHED un-NATed conntrack entry for each
// connected TCP socket of the netns that has none, applies the rules and
// removes the drain (istio-cni's rules hold conntrack from then on).
//
// A pod that already has exactly that state is left alone; istio-cni
// state of its in b that is not (other options, hand edits) is replaced.
// A pod with istio-cni's rules in another backend is refused. On failure
// nothing is left half-applied: istio-cni's rules in b are removed again,
// so are the return-path entries and the drain ApplyPod added. After it,
// InspectPod reports Equivalent with Options o.
func (mgr *RuleManager) ApplyPod(ctx context.Context, path string, b Backend, o podopts.Options) error {
	ts, err := mgr.backendTools(b)
	if err != nil {
		return fmt.Errorf("netns %s: %w", path, err)
	}
	p, err := mgr.InspectPod(ctx, path)
	if err != nil {
		return err
	}
	if p.Equivalent && p.Options.Equal(o) && slices.Equal(p.Backends(), []Backend{b}) {
		return nil
	}
	if others := slices.DeleteFunc(p.Backends(), func(x Backend) bool { return x == b }); len(others) > 0 {
		return fmt.Errorf("netns %s: apply istio-cni's rules in %s: the pod holds them in %v already", path, b, others)
	}
	hadDrain, err := HasDrain(ctx, path)
	if err != nil {
		return err
	}
	if err := InstallDrain(ctx, path); err != nil {
		return err
	}
	// Rolled back on failure: the drain, unless it was there before.
	fail := func(err error) error {
		if !hadDrain {
			err = errors.Join(err, RemoveDrain(context.WithoutCancel(ctx), path))
		}
		return err
	}
	if err := trackEstablished(ctx, path); err != nil {
		return fail(err)
	}
	err = undoing(path, fmt.Sprintf("apply istio-cni's rules (%s, %s)", b, o), func(undo *[]func() error) error {
		return mgr.applyPod(ctx, path, b, ts, o, undo)
	})
	if err != nil {
		return fail(err)
	}
	if !hadDrain {
		return RemoveDrain(ctx, path)
	}
	return nil
}

// undoing runs fn on a thread in the netns at path; fn adds to undo what
// takes each of its steps back, and when it fails they run there, last
// first, so nothing it did is left.
func undoing(path, what string, fn func(undo *[]func() error) error) error {
	return inNetns(path, func() error {
		var undo []func() error
		err := fn(&undo)
		if err == nil {
			return nil
		}
		errs := []error{fmt.Errorf("netns %s: %s: %w", path, what, err)}
		for _, u := range slices.Backward(undo) {
			errs = append(errs, u())
		}
		return errors.Join(errs...)
	})
}

// applyPod writes the return path and the rules in the thread's netns,
// adding to undo what takes each step back.
func (mgr *RuleManager) applyPod(ctx context.Context, path string, b Backend, ts []tools, o podopts.Options, undo *[]func() error) error {
	u, err := ensureReturnPath(path)
	*undo = append(*undo, u...)
	if err != nil {
		return err
	}
	cleanup := context.WithoutCancel(ctx)
	if b == Nftables {
		*undo = append(*undo, func() error {
			return mgr.deleteNftTables(cleanup, path, []string{NftNatTable, NftMangleTable, NftRawTable})
		})
		return mgr.applyNft(ctx, path, o)
	}
	*undo = append(*undo, func() error {
		var errs []error
		for _, t := range ts {
			errs = append(errs, removeChains(cleanup, path, t, podChains))
		}
		return errors.Join(errs...)
	})
	for _, t := range ts {
		if err := applyIptables(ctx, path, t, RenderInpod(o, t.family), podChains); err != nil {
			return err
		}
	}
	return nil
}

// backendTools are the iptables tools of b, both families; none for
// nftables, which needs nft.
func (mgr *RuleManager) backendTools(b Backend) ([]tools, error) {
	switch b {
	case Nftables:
		if mgr.nft == "" {
			return nil, fmt.Errorf("backend %s: nft is not installed", b)
		}
		return nil, nil
	case Legacy, NftCompat:
		var ts []tools
		for _, t := range mgr.iptables {
			if t.backend == b {
				ts = append(ts, t)
			}
		}
		if len(ts) != 2 {
			return nil, fmt.Errorf("backend %s: its iptables binaries are not installed (missing %v)", b, mgr.missing)
		}
		return ts, nil
	}
	return nil, fmt.Errorf("unknown backend %q", b)
}

// applyIptables writes a rendered istio-cni rule set (restore --noflush
// input) with one backend and family in the thread's netns. If the chains
// are there already they are removed first: re-declaring them would flush
// them but leave the jumps into them doubled.
func applyIptables(ctx context.Context, where string, t tools, input string, chains []string) error {
	out, err := run(ctx, where, "", t.save)
	if err != nil {
		return err
	}
	s, err := ParseSave(out)
	if err != nil {
		return fmt.Errorf("parse %s output: %w", t.save, err)
	}
	if _, ok := istioPart(s, chains); ok {
		if err := removeChains(ctx, where, t, chains); err != nil {
			return err
		}
	}
	if _, err := run(ctx, where, input, t.restore, "--noflush"); err != nil {
		return fmt.Errorf("%s %s, tables %s: %w", t.backend, t.family.Name, strings.Join(renderedTables(input), ","), err)
	}
	return nil
}

// renderedTables names the tables of restore input.
func renderedTables(input string) []string {
	var names []string
	for _, l := range strings.Split(input, "\n") {
		if name, ok := strings.CutPrefix(l, "*"); ok {
			names = append(names, name)
		}
	}
	return names
}

// applyNft writes istio-cni's nftables tables for o in one transaction,
// replacing whatever tables of those names are there.
func (mgr *RuleManager) applyNft(ctx context.Context, where string, o podopts.Options) error {
	var script strings.Builder
	for _, name := range []string{NftNatTable, NftMangleTable, NftRawTable} {
		// Add then delete: the delete succeeds whether or not it is there.
		fmt.Fprintf(&script, "add table inet %s\ndelete table inet %s\n", name, name)
	}
	script.WriteString(RenderNft(o, true))
	if _, err := run(ctx, where, script.String(), mgr.nft, "-f", "-"); err != nil {
		return fmt.Errorf("nftables, tables %s, %s, %s: %w", NftNatTable, NftMangleTable, NftRawTable, err)
	}
	return nil
}

// ensureReturnPath adds, in the thread's netns, whichever of istio-cni's
// policy rules and local routes of table 100 are missing; the undo
// functions remove what it added.
func ensureReturnPath(where string) ([]func() error, error) {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netns %s: netlink: %w", where, err)
	}
	lo, err := h.LinkByName("lo")
	if err != nil {
		h.Close()
		return nil, fmt.Errorf("netns %s: link lo: %w", where, err)
	}
	var undo []func() error
	// The undo functions run on the same netns-switched thread, later:
	// each opens its own handle there.
	withHandle := func(fn func(*netlink.Handle) error) func() error {
		return func() error {
			h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
			if err != nil {
				return fmt.Errorf("netns %s: netlink: %w", where, err)
			}
			defer h.Close()
			return fn(h)
		}
	}
	defer h.Close()
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := h.RuleList(fam)
		if err != nil {
			return undo, fmt.Errorf("netns %s: list rules: %w", where, err)
		}
		if !slices.ContainsFunc(rules, isReturnRule) {
			r := netlink.NewRule()
			r.Family, r.Priority, r.Table, r.Mark = fam, ReturnRulePref, ReturnTable, ReturnMark
			mask := uint32(ReturnMask)
			r.Mask = &mask
			if err := h.RuleAdd(r); err != nil && !errors.Is(err, unix.EEXIST) {
				return undo, fmt.Errorf("netns %s: ip rule add fwmark 0x111/0xfff pref 32764 lookup 100 (family %d): %w", where, fam, err)
			}
			undo = append(undo, withHandle(func(h *netlink.Handle) error {
				if err := h.RuleDel(r); err != nil && !errors.Is(err, unix.ENOENT) {
					return fmt.Errorf("netns %s: ip rule del fwmark 0x111/0xfff pref 32764 lookup 100 (family %d): %w", where, fam, err)
				}
				return nil
			}))
		}
		routes, err := h.RouteListFiltered(fam, &netlink.Route{Table: ReturnTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return undo, fmt.Errorf("netns %s: list routes of table %d: %w", where, ReturnTable, err)
		}
		if slices.ContainsFunc(routes, func(r netlink.Route) bool { return isReturnRoute(h, r) }) {
			continue
		}
		dst := &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
		if fam == unix.AF_INET6 {
			dst = &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
		}
		rt := &netlink.Route{Family: fam, Table: ReturnTable, Type: unix.RTN_LOCAL, Scope: unix.RT_SCOPE_HOST,
			LinkIndex: lo.Attrs().Index, Dst: dst}
		if err := h.RouteReplace(rt); err != nil {
			return undo, fmt.Errorf("netns %s: ip route replace local %s dev lo table 100: %w", where, dst, err)
		}
		undo = append(undo, withHandle(func(h *netlink.Handle) error {
			if err := h.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("netns %s: ip route del local %s dev lo table 100: %w", where, dst, err)
			}
			return nil
		}))
	}
	return undo, nil
}

// trackEstablished creates an ESTABLISHED, un-NATed conntrack entry for
// each connected TCP socket of the netns at path that has none: the
// original direction from the connection's client (the side whose port is
// not a listener's) to its server.
//
// First it deletes the un-NATed TCP entries that no connected socket is
// behind (deleteStaleFlows): their connections ended while conntrack was
// off in the pod (a takeover's drain gone, nothing else holding it), so
// conntrack never saw them end, and an ESTABLISHED entry lives five days.
// A new connection whose tuple is that of such an entry (the same client
// port again) would match it, and conntrack ignores a SYN in ESTABLISHED:
// the packet keeps the entry's null NAT binding, istio-cni's REDIRECT is
// never consulted, and the connection reaches the app past ztunnel (seen
// once in the takeover suite on 6.12, 30 s after the hand-back).
func trackEstablished(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ns, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	c, err := conntrack.Dial(&mdnetlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		return fmt.Errorf("netns %s: dial conntrack netlink: %w", path, err)
	}
	defer c.Close()
	// The entries before the sockets: a connection made in between has a
	// socket but no entry listed, so its entry is never taken for stale.
	flows, err := c.Dump(nil)
	if err != nil {
		return fmt.Errorf("netns %s: dump conntrack: %w", path, err)
	}
	var conns [][2]netip.AddrPort // client, server
	err = inNetns(path, func() error {
		var err error
		conns, err = connectedTCP(path)
		return err
	})
	if err != nil {
		return err
	}
	if err := deleteStaleFlows(c, path, flows, conns); err != nil {
		return err
	}
	for _, cs := range conns {
		client, server := cs[0], cs[1]
		// No status bits: kernels refuse SEEN_REPLY and ASSURED on create
		// (EBUSY); the flow's next segments set them.
		f := conntrack.NewFlow(unix.IPPROTO_TCP, 0, client.Addr(), server.Addr(), client.Port(), server.Port(), establishedTimeout, 0)
		f.ProtoInfo.TCP = &conntrack.ProtoInfoTCP{State: tcpConntrackEstablished}
		if err := c.Create(f); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("netns %s: conntrack create tcp %s -> %s: %w", path, client, server, err)
		}
	}
	return nil
}

// deleteStaleFlows deletes the un-NATed TCP conntrack entries of flows
// that are in no connection of conns (either way round). Entries with NAT
// are istio-cni's REDIRECTs: a new connection with their tuple gets the
// same binding, so they stay.
func deleteStaleFlows(c *conntrack.Conn, path string, flows []conntrack.Flow, conns [][2]netip.AddrPort) error {
	live := make(map[[2]netip.AddrPort]bool, 2*len(conns))
	for _, cs := range conns {
		live[cs] = true
		live[[2]netip.AddrPort{cs[1], cs[0]}] = true
	}
	for _, f := range flows {
		o := f.TupleOrig
		if o.Proto.Protocol != unix.IPPROTO_TCP || f.Status.SrcNAT() || f.Status.DstNAT() {
			continue
		}
		t := [2]netip.AddrPort{netip.AddrPortFrom(o.IP.SourceAddress.Unmap(), o.Proto.SourcePort),
			netip.AddrPortFrom(o.IP.DestinationAddress.Unmap(), o.Proto.DestinationPort)}
		if live[t] {
			continue
		}
		if err := c.Delete(f); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("netns %s: conntrack delete stale tcp %s -> %s: %w", path, t[0], t[1], err)
		}
	}
	return nil
}

// connectedTCP lists the thread's netns's TCP connections (sock_diag), as
// client and server address, each once.
func connectedTCP(where string) ([][2]netip.AddrPort, error) {
	h, err := netlink.NewHandle(unix.NETLINK_INET_DIAG)
	if err != nil {
		return nil, fmt.Errorf("netns %s: sock_diag netlink: %w", where, err)
	}
	defer h.Close()
	var socks []*netlink.Socket
	for _, fam := range []uint8{unix.AF_INET, unix.AF_INET6} {
		var s []*netlink.Socket
		for range 3 { // a dump interrupted by a change is retried
			if s, err = h.SocketDiagTCP(fam); !errors.Is(err, netlink.ErrDumpInterrupted) {
				break
			}
		}
		if err != nil {
			return nil, fmt.Errorf("netns %s: sock_diag dump tcp (family %d): %w", where, fam, err)
		}
		socks = append(socks, s...)
	}
	addr := func(ip []byte, port uint16) netip.AddrPort {
		a, _ := netip.AddrFromSlice(ip)
		return netip.AddrPortFrom(a.Unmap(), port)
	}
	var listeners []netip.AddrPort
	for _, s := range socks {
		if s.State == tcpListen {
			listeners = append(listeners, addr(s.ID.Source, s.ID.SourcePort))
		}
	}
	listening := func(a netip.AddrPort) bool {
		return slices.ContainsFunc(listeners, func(l netip.AddrPort) bool {
			return l.Port() == a.Port() && (l.Addr() == a.Addr() || l.Addr().IsUnspecified())
		})
	}
	var conns [][2]netip.AddrPort
	for _, s := range socks {
		switch s.State {
		case tcpEstablished, tcpFinWait1, tcpFinWait2, tcpCloseWait, tcpLastAck, tcpClosing:
		default:
			continue
		}
		local, remote := addr(s.ID.Source, s.ID.SourcePort), addr(s.ID.Destination, s.ID.DestinationPort)
		c := [2]netip.AddrPort{local, remote}
		if listening(local) {
			c = [2]netip.AddrPort{remote, local}
		}
		if !slices.Contains(conns, c) { // both ends of a connection inside the pod
			conns = append(conns, c)
		}
	}
	return conns, nil
}

// ApplyNode writes istio-cni's host-probe state in the node netns at
// path with backend b: the probe ipsets istio-inpod-probes-v4/v6 (hash:ip
// with comments; kept, entries and all, when they are there), then per
// family RenderHost, the ISTIO_POSTRT chain with its jump inserted at
// position 1 of nat POSTROUTING. A family whose chain is already exactly
// istio-cni's is left alone; one with another ISTIO_POSTRT (or its jump
// elsewhere) has it replaced. On failure what it added is removed again.
// The nftables backend is refused: RenderNft renders the in-pod tables
// only, not istio-cni's native host table.
func (mgr *RuleManager) ApplyNode(ctx context.Context, path string, b Backend) error {
	if b == Nftables {
		return fmt.Errorf("netns %s: apply istio-cni's host rules: backend %s is not supported (only its in-pod tables are rendered)", path, b)
	}
	ts, err := mgr.backendTools(b)
	if err != nil {
		return fmt.Errorf("netns %s: %w", path, err)
	}
	n, err := mgr.InspectNode(ctx, path)
	if err != nil {
		return err
	}
	exact := map[string]bool{}
	for _, r := range n.Iptables {
		if r.Backend == b && r.Exact && slices.Equal(r.Jumps, []string{"nat: -A POSTROUTING -j " + ChainHostPostrouting}) {
			exact[r.Family] = true
		}
	}
	return undoing(path, fmt.Sprintf("apply istio-cni's host rules (%s)", b), func(undo *[]func() error) error {
		return mgr.applyNode(ctx, path, ts, n, exact, undo)
	})
}

func (mgr *RuleManager) applyNode(ctx context.Context, path string, ts []tools, n *Node, exact map[string]bool, undo *[]func() error) error {
	cleanup := context.WithoutCancel(ctx)
	var created []string
	for _, set := range []string{ProbeSetV4, ProbeSetV6} {
		if _, ok := n.IPSets[set]; !ok {
			created = append(created, set)
		}
	}
	*undo = append(*undo, func() error { return destroyIPSets(cleanup, path, created) })
	if err := createProbeSets(); err != nil {
		return err
	}
	for _, t := range ts {
		if exact[t.family.Name] {
			continue
		}
		*undo = append(*undo, func() error { return removeChains(cleanup, path, t, hostChains) })
		if err := applyIptables(ctx, path, t, RenderHost(t.family), hostChains); err != nil {
			return err
		}
	}
	return nil
}

// ipsetReleaseWait bounds how long destroyIPSets waits for a set the
// rules just deleted still hold.
const ipsetReleaseWait = 5 * time.Second

// ipsetBusy says whether ipset refused for a set still referenced.
func ipsetBusy(err error) bool {
	return errors.Is(err, nl.IPSetError(nl.IPSET_ERR_BUSY)) || errors.Is(err, unix.EBUSY)
}

// destroyIPSets destroys the named ipsets of the thread's netns. A set an
// iptables-nft rule named stays referenced for a moment after the rule is
// deleted on older kernels (5.10: nf_tables releases the rule's xt_set
// match from a work queue after the commit), so "busy" is retried for a
// while.
func destroyIPSets(ctx context.Context, where string, sets []string) error {
	if len(sets) == 0 {
		return nil
	}
	h, err := netlink.NewHandle(unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("netns %s: netlink: %w", where, err)
	}
	defer h.Close()
	var errs []error
	for _, set := range sets {
		err := h.IpsetDestroy(set)
		for deadline := time.Now().Add(ipsetReleaseWait); ipsetBusy(err) && time.Now().Before(deadline) && ctx.Err() == nil; err = h.IpsetDestroy(set) {
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("netns %s: ipset destroy %s: %w", where, set, err))
		}
	}
	return errors.Join(errs...)
}

// AddProbeEntries adds a pod's IPs to istio-cni's probe ipsets in the node
// netns at path (IPv4 to istio-inpod-probes-v4, IPv6 to -v6), the pod's
// UID as the comment, as istio-cni does; an entry already there for the
// IP is replaced, so it may run again. The sets must exist (ApplyNode).
func (mgr *RuleManager) AddProbeEntries(ctx context.Context, path, uid string, ips []netip.Addr) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return eachProbeSet(path, ips, func(h *netlink.Handle, set string, ip netip.Addr) error {
		if err := h.IpsetAdd(set, &netlink.IPSetEntry{IP: ip.AsSlice(), Comment: uid, Replace: true}); err != nil {
			return fmt.Errorf("netns %s: ipset add %s %s comment %s: %w", path, set, ip, uid, err)
		}
		return nil
	})
}
