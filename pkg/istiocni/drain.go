// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/mdlayher/netlink"
	"github.com/ti-mo/conntrack"
	"golang.org/x/sys/unix"
)

// The drain: why removing istio-cni's rules would reset its connections.
//
// Connection tracking and NAT in a netns are not always on: their netfilter
// hooks are registered in a netns on demand, by their users
// (nf_ct_netns_get: the xt REDIRECT, CONNMARK and CT targets, the nft ct
// and nat expressions), and unregistered when the last user goes. In a pod
// istio-cni's rules are usually the only users. Removing them unregisters
// conntrack in the pod netns: the entries of the connections redirected to
// ztunnel are still listed, but no packet is looked up in them any more,
// so an established redirected stream's packets leave un-translated (the
// app's segments go to the real destination, which answers a connection it
// never saw with a RST). An empty nat base chain, as iptables-nft leaves
// behind, holds the NAT hook but not conntrack; the legacy nat table holds
// neither once its rules are gone.
//
// So a takeover holds conntrack and NAT in the pod with a table of its own
// before it removes istio-cni's: the drain, table inet ambient-ebpf-drain,
// a nat base chain at each of the four NAT hooks (dstnat at prerouting and
// output, srcnat at input and postrouting: an outbound flow's DNAT at output
// is undone at input, an inbound flow's at prerouting is undone at
// postrouting) whose one rule "ct state established,related accept" changes
// no verdict: its ct expression holds conntrack, its chain the NAT hook. A
// route chain at output copies istio-cni's own return-path rule, "ct mark
// and 0xfff == 0x111 meta mark set ct mark": ztunnel's inbound deliveries
// made under istio-cni carry the return mark in their conntrack entry only
// (istio-cni's mangle rules set and restore it), and without it the app's
// replies to the client's address would be routed out of the pod. The eBPF
// redirection marks its own deliveries' sockets, so the rule only matches
// connections istio-cni accepted.
//
// The takeover of a pod: enrol it in eBPF; InstallDrain; RemovePod with
// KeepReturnPath; later, once RedirectedFlows is 0, RemoveDrain.
const DrainTable = "ambient-ebpf-drain"

// ztunnelPorts are the ports istio-cni redirects to: outbound, inbound
// and DNS.
var ztunnelPorts = []uint16{15001, 15006, 15053}

// Conntrack's TCP states (enum tcp_conntrack) after which a flow is over.
const (
	tcpConntrackTimeWait = 7
	tcpConntrackClose    = 8
)

// InstallDrain creates (or re-creates, in one transaction) the drain table
// in the pod netns at path. The netns keeps conntrack and NAT for as long
// as the table exists, whatever other rules come and go.
func InstallDrain(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return withNft(path, func(c *nftables.Conn) error {
		t := &nftables.Table{Name: DrainTable, Family: nftables.TableFamilyINet}
		// Add then delete makes the delete succeed whether or not the table
		// is there; the table added after is the whole drain. One batch:
		// the old ct expressions are released only after the new ones hold
		// conntrack, so it never goes away in between.
		c.AddTable(t)
		c.DelTable(t)
		c.AddTable(t)
		established := []expr.Any{
			&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
				Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
				Xor:  binaryutil.NativeEndian.PutUint32(0)},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
			&expr.Verdict{Kind: expr.VerdictAccept},
		}
		for _, ch := range []struct {
			name     string
			hook     *nftables.ChainHook
			priority *nftables.ChainPriority
		}{
			{"prerouting", nftables.ChainHookPrerouting, nftables.ChainPriorityNATDest},
			{"input", nftables.ChainHookInput, nftables.ChainPriorityNATSource},
			{"output", nftables.ChainHookOutput, nftables.ChainPriorityNATDest},
			{"postrouting", nftables.ChainHookPostrouting, nftables.ChainPriorityNATSource},
		} {
			chain := c.AddChain(&nftables.Chain{Name: ch.name, Table: t, Type: nftables.ChainTypeNAT, Hooknum: ch.hook, Priority: ch.priority})
			c.AddRule(&nftables.Rule{Table: t, Chain: chain, Exprs: established})
		}
		mangle := c.AddChain(&nftables.Chain{Name: "return-mark", Table: t, Type: nftables.ChainTypeRoute,
			Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityMangle})
		c.AddRule(&nftables.Rule{Table: t, Chain: mangle, Exprs: []expr.Any{
			&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
				Mask: binaryutil.NativeEndian.PutUint32(0xfff), Xor: binaryutil.NativeEndian.PutUint32(0)},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(ReturnMark)},
			&expr.Ct{Register: 1, Key: expr.CtKeyMARK},
			&expr.Meta{Key: expr.MetaKeyMARK, SourceRegister: true, Register: 1},
		}})
		if err := c.Flush(); err != nil {
			return fmt.Errorf("netns %s: create nftables table inet %s: %w", path, DrainTable, err)
		}
		return nil
	})
}

// RemoveDrain deletes the drain table from the pod netns at path, if it is
// there. Call it once RedirectedFlows is 0: conntrack then goes, unless
// something else in the pod holds it.
func RemoveDrain(ctx context.Context, path string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return withNft(path, func(c *nftables.Conn) error {
		t := &nftables.Table{Name: DrainTable, Family: nftables.TableFamilyINet}
		c.AddTable(t) // so the delete succeeds when it is already gone
		c.DelTable(t)
		if err := c.Flush(); err != nil {
			return fmt.Errorf("netns %s: delete nftables table inet %s: %w", path, DrainTable, err)
		}
		return nil
	})
}

// HasDrain says whether the pod netns at path has the drain table.
func HasDrain(ctx context.Context, path string) (bool, error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	var found bool
	err := withNft(path, func(c *nftables.Conn) error {
		tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
		if err != nil {
			return fmt.Errorf("netns %s: list nftables tables: %w", path, err)
		}
		for _, t := range tables {
			found = found || t.Name == DrainTable
		}
		return nil
	})
	return found, err
}

// RedirectedFlows counts the live connections of the pod netns at path
// that istio-cni redirected to ztunnel: conntrack entries with destination
// NAT whose reply comes from 15001, 15006 or 15053 and that saw a reply,
// TCP ones not yet in TIME_WAIT or CLOSE. Once it is 0 the drain has
// nothing left to hold.
//
// An entry that never saw a reply holds no connection: a SYN nobody
// answered (a client port that came back onto a tuple in use, a listener
// gone) stays in SYN_SENT for up to two minutes, refreshed by each
// retransmission, and waiting for it would hold the drain, and the
// takeover's end, that long for nothing; its next retransmission is a new
// connection for the eBPF redirection.
func RedirectedFlows(ctx context.Context, path string) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	ns, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	c, err := conntrack.Dial(&netlink.Config{NetNS: int(ns.Fd())})
	if err != nil {
		return 0, fmt.Errorf("netns %s: dial conntrack netlink: %w", path, err)
	}
	defer c.Close()
	flows, err := c.Dump(nil)
	if err != nil {
		return 0, fmt.Errorf("netns %s: dump conntrack: %w", path, err)
	}
	n := 0
	for _, f := range flows {
		if redirected(f) {
			n++
		}
	}
	return n, nil
}

func redirected(f conntrack.Flow) bool {
	if !f.Status.DstNAT() || !f.Status.SeenReply() {
		return false
	}
	port := f.TupleReply.Proto.SourcePort
	if port != ztunnelPorts[0] && port != ztunnelPorts[1] && port != ztunnelPorts[2] {
		return false
	}
	if f.TupleOrig.Proto.Protocol == unix.IPPROTO_TCP && f.ProtoInfo.TCP != nil {
		if s := f.ProtoInfo.TCP.State; s == tcpConntrackTimeWait || s == tcpConntrackClose {
			return false
		}
	}
	return true
}

// withNft runs fn with an nftables netlink connection in the netns at path.
func withNft(path string, fn func(*nftables.Conn) error) error {
	ns, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer ns.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Fd())), nftables.AsLasting())
	if err != nil {
		return fmt.Errorf("netns %s: nftables netlink: %w", path, err)
	}
	return errors.Join(fn(c), c.CloseLasting())
}
