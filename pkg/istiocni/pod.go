// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// The return path istio-cni sets up in a pod: packets marked 0x111/0xfff
// look up table 100, which delivers everything locally over lo.
const (
	ReturnMark     = 0x111
	ReturnMask     = 0xfff
	ReturnTable    = 100
	ReturnRulePref = 32764
)

// IptablesRules is istio-cni's state in one iptables backend and family.
type IptablesRules struct {
	Backend Backend
	Family  string
	Chains  []string        // "table/chain" of its chains
	Jumps   []string        // "table: -A CHAIN SPEC" of the rules that jump into them
	Options podopts.Options // as the rules express them
	Exact   bool            // the rules are exactly what istio-cni writes for Options
	Diff    string          // when not: the first difference
}

// NftTables is istio-cni's native nftables state (inet tables).
type NftTables struct {
	Tables  []string // of istio-ambient-nat, -mangle, -raw: the ones present
	IPv6    bool     // the tables hold ip6 rules too
	Options podopts.Options
	Exact   bool
	Diff    string
}

// Pod is what Inspect found in a pod's netns.
type Pod struct {
	Netns    string
	Iptables []IptablesRules // per backend and family that holds istio-cni chains
	Nft      *NftTables      // nil: no istio-ambient-* table
	// The return path: per family, the policy rule and table 100's local
	// default route over lo.
	Rule4, Rule6, Route4, Route6 bool
	// Other routes in table 100 (not istio-cni's; not removed).
	OtherRoutes []string
	// Options as the rules express them (those of the first backend found).
	Options podopts.Options
	// Equivalent: istio-cni's state is exactly what it writes for Options,
	// in one backend (or the same in both iptables backends, as istio-cni
	// leaves pods after its restart: unevenBackends), with its return
	// path: an eBPF enrolment with Options redirects the same traffic, and
	// Remove takes out all of it.
	Equivalent bool
	Reasons    []string // why not (empty when Equivalent, or nothing was found)
	// Binaries not found: those backends were not looked at.
	Unchecked []string
}

// Found says whether any of istio-cni's in-pod state is there.
func (p *Pod) Found() bool {
	return len(p.Iptables) > 0 || p.Nft != nil || p.Rule4 || p.Rule6 || p.Route4 || p.Route6
}

// Backends lists the backends holding istio-cni's rules.
func (p *Pod) Backends() []Backend {
	var out []Backend
	for _, r := range p.Iptables {
		if !slices.Contains(out, r.Backend) {
			out = append(out, r.Backend)
		}
	}
	if p.Nft != nil {
		out = append(out, Nftables)
	}
	return out
}

var podChains = []string{ChainPrerouting, ChainOutput}

// InspectPod reads istio-cni's state in the pod netns at path. It changes
// nothing. An error means the netns or a tool could not be read (a netns
// that is gone: errors.Is(err, fs.ErrNotExist)).
func (mgr *RuleManager) InspectPod(ctx context.Context, path string) (*Pod, error) {
	p := &Pod{Netns: path, Unchecked: mgr.missing}
	saves := map[tools]string{}
	var nftOut string
	err := inNetns(path, func() error {
		for _, t := range mgr.iptables {
			out, err := run(ctx, path, "", t.save)
			if err != nil {
				return err
			}
			saves[t] = out
		}
		if mgr.nft != "" {
			out, err := mgr.listNft(ctx, path, []string{NftNatTable, NftMangleTable, NftRawTable})
			if err != nil {
				return err
			}
			nftOut = out
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, t := range mgr.iptables {
		s, err := ParseSave(saves[t])
		if err != nil {
			return nil, fmt.Errorf("netns %s: parse %s output: %w", path, t.save, err)
		}
		r, ok := istioPart(s, podChains)
		if !ok {
			continue
		}
		fr := IptablesRules{Backend: t.backend, Family: t.family.Name, Chains: r.chains, Jumps: r.jumps, Options: iptablesOptions(s)}
		want, err := mgr.canonicalIptables(ctx, t, RenderInpod(fr.Options, t.family), nil)
		if err != nil {
			return nil, err
		}
		ws, err := ParseSave(want)
		if err != nil {
			return nil, fmt.Errorf("parse %s output of the expected rules: %w", t.save, err)
		}
		w, _ := istioPart(ws, podChains)
		fr.Diff = firstDiff(r.lines, w.lines)
		fr.Exact = fr.Diff == ""
		p.Iptables = append(p.Iptables, fr)
	}
	if nftOut != "" {
		nt := &NftTables{Options: nftOptions(nftOut), IPv6: strings.Contains(nftOut, " ip6 ")}
		for _, name := range []string{NftNatTable, NftMangleTable, NftRawTable} {
			if strings.Contains(nftOut, "table inet "+name+" {") {
				nt.Tables = append(nt.Tables, name)
			}
		}
		want, err := mgr.canonicalNft(ctx, RenderNft(nt.Options, nt.IPv6))
		if err != nil {
			return nil, err
		}
		nt.Diff = firstDiff(nftLines(nftOut), nftLines(want))
		nt.Exact = nt.Diff == ""
		p.Nft = nt
	}
	if err := p.readReturnPath(); err != nil {
		return nil, err
	}
	p.judge()
	return p, nil
}

// judge sets Options, Equivalent and Reasons.
func (p *Pod) judge() {
	if !p.Found() {
		return
	}
	var why []string
	backends := p.Backends()
	if len(backends) == 0 {
		why = append(why, "istio-cni's return path is there without its redirection rules")
	}
	if p.Nft != nil && len(backends) > 1 {
		why = append(why, fmt.Sprintf("istio-cni's rules are in more than one backend: %v", backends))
	}
	if r := p.unevenBackends(); r != "" {
		why = append(why, r)
	}
	v4, v6 := false, false
	first := true
	setOpts := func(o podopts.Options, what string) {
		if first {
			p.Options, first = o, false
		} else if !p.Options.Equal(o) {
			why = append(why, fmt.Sprintf("%s expresses other options (%s) than the rest (%s)", what, o, p.Options))
		}
	}
	for _, r := range p.Iptables {
		what := string(r.Backend) + " " + r.Family
		setOpts(r.Options, what)
		if !r.Exact {
			why = append(why, what+": not the rules istio-cni writes: "+r.Diff)
		}
		v4 = v4 || r.Family == IPv4.Name
		v6 = v6 || r.Family == IPv6.Name
	}
	if p.Nft != nil {
		setOpts(p.Nft.Options, "nftables")
		if !p.Nft.Exact {
			why = append(why, "nftables: not the tables istio-cni writes: "+p.Nft.Diff)
		}
		v4, v6 = true, v6 || p.Nft.IPv6
	}
	if len(p.Iptables) > 0 && !v4 {
		why = append(why, "IPv6 rules without IPv4 rules")
	}
	if v4 && !(p.Rule4 && p.Route4) {
		why = append(why, "the IPv4 return path (rule fwmark 0x111/0xfff pref 32764 lookup 100, local 0.0.0.0/0 dev lo table 100) is incomplete")
	}
	if v6 && !(p.Rule6 && p.Route6) {
		why = append(why, "the IPv6 return path (rule fwmark 0x111/0xfff pref 32764 lookup 100, local ::/0 dev lo table 100) is incomplete")
	}
	if len(p.OtherRoutes) > 0 {
		why = append(why, "table 100 holds other routes: "+strings.Join(p.OtherRoutes, "; "))
	}
	p.Reasons = why
	p.Equivalent = len(why) == 0
}

// unevenBackends says why rules in both iptables backends are not one
// rule set written twice. istio-cni writes its rules twice itself: its
// backend detection probes iptables-legacy by adding a rule, which makes
// the legacy tables of a netns show in iptables-legacy-save from then on,
// so where the kernel has legacy iptables its first start picks
// iptables-nft and every later start (a rolling update) picks legacy and
// writes every running pod's rules again there, keeping the nft ones
// (istio/istio#61020). Both copies redirect the same traffic, and
// RemovePod takes out both; they must cover the same families (the rest,
// exactness and options, is judged per backend and family).
func (p *Pod) unevenBackends() string {
	families := map[Backend][]string{}
	for _, r := range p.Iptables {
		families[r.Backend] = append(families[r.Backend], r.Family)
	}
	if len(families) < 2 {
		return ""
	}
	var first []string
	var firstB Backend
	for _, b := range slices.Sorted(maps.Keys(families)) {
		fs := families[b]
		slices.Sort(fs)
		if first == nil {
			first, firstB = fs, b
			continue
		}
		if !slices.Equal(fs, first) {
			return fmt.Sprintf("istio-cni's rules are in more than one backend, for other families: %s has %v, %s %v", firstB, first, b, fs)
		}
	}
	return ""
}

// part is istio-cni's share of one iptables-save output.
type part struct {
	chains, jumps []string
	lines         []string // chains, jumps and the chains' rules, table by table, for comparison
}

// istioPart picks out the named chains, the rules in them and the rules
// jumping to them; ok is false when no table has any of them.
func istioPart(s *Save, names []string) (part, bool) {
	var p part
	// Compared table by table, chain by chain (both by name), rules in
	// order within a chain: the order a save prints tables and chains in
	// depends on what else was created first.
	tables := slices.Clone(s.Tables)
	slices.SortFunc(tables, func(a, b *Table) int { return strings.Compare(a.Name, b.Name) })
	for _, t := range tables {
		var decl []string
		for _, c := range t.Chains {
			if slices.Contains(names, c.Name) {
				p.chains = append(p.chains, t.Name+"/"+c.Name)
				decl = append(decl, t.Name+": :"+c.Name+" "+c.Policy)
			}
		}
		slices.Sort(decl)
		p.lines = append(p.lines, decl...)
		byChain := map[string][]string{}
		for _, r := range t.Rules {
			switch {
			case slices.Contains(names, r.Chain):
				byChain[r.Chain] = append(byChain[r.Chain], t.Name+": "+r.String())
			case slices.Contains(names, r.Target()):
				p.jumps = append(p.jumps, t.Name+": "+r.String())
				byChain[r.Chain] = append(byChain[r.Chain], t.Name+": "+r.String())
			}
		}
		chains := make([]string, 0, len(byChain))
		for c := range byChain {
			chains = append(chains, c)
		}
		slices.Sort(chains)
		for _, c := range chains {
			p.lines = append(p.lines, byChain[c]...)
		}
	}
	return p, len(p.chains) > 0 || len(p.jumps) > 0
}

// iptablesOptions reads the options off istio-cni's nat rules: reroute
// interfaces from their :15001 redirects in ISTIO_PRERT, ingress mode from
// the absence of the :15006 redirect, DNS capture from :15053 redirects.
func iptablesOptions(s *Save) podopts.Options {
	var o podopts.Options
	nat := s.Table("nat")
	if nat == nil {
		return o
	}
	inbound := false
	for _, r := range nat.Rules {
		f := strings.Fields(r.Spec)
		switch r.Chain {
		case ChainPrerouting:
			if slices.Contains(f, "15006") {
				inbound = true
			}
			if i := slices.Index(f, "-i"); i >= 0 && i+1 < len(f) && slices.Contains(f, "REDIRECT") && slices.Contains(f, "15001") {
				o.RerouteInterfaces = append(o.RerouteInterfaces, f[i+1])
			}
		case ChainOutput:
			if slices.Contains(f, "15053") {
				o.DNSCapture = true
			}
		}
	}
	o.BypassInbound = !inbound
	return o
}

// firstDiff describes the first line where have and want differ.
func firstDiff(have, want []string) string {
	for i := 0; i < len(have) || i < len(want); i++ {
		switch {
		case i >= len(have):
			return fmt.Sprintf("missing %q", want[i])
		case i >= len(want):
			return fmt.Sprintf("unexpected %q", have[i])
		case have[i] != want[i]:
			return fmt.Sprintf("have %q where istio-cni writes %q", have[i], want[i])
		}
	}
	return ""
}

// canonicalIptables applies input with the backend's restore in a scratch
// netns and returns the backend's save of it.
func (mgr *RuleManager) canonicalIptables(ctx context.Context, t tools, input string, prepare func() error) (string, error) {
	key := t.save + "\x00" + input
	mgr.mu.Lock()
	out, ok := mgr.canon[key]
	mgr.mu.Unlock()
	if ok {
		return out, nil
	}
	err := inScratchNetns(func() error {
		if prepare != nil {
			if err := prepare(); err != nil {
				return err
			}
		}
		if _, err := run(ctx, "scratch", input, t.restore, "--noflush"); err != nil {
			return err
		}
		var err error
		out, err = run(ctx, "scratch", "", t.save)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("render the expected rules: %w", err)
	}
	mgr.mu.Lock()
	mgr.canon[key] = out
	mgr.mu.Unlock()
	return out, nil
}

func (p *Pod) readReturnPath() error {
	return inNetns(p.Netns, func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return fmt.Errorf("netns %s: netlink: %w", p.Netns, err)
		}
		defer h.Close()
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			rules, err := h.RuleList(fam)
			if err != nil {
				return fmt.Errorf("netns %s: list rules: %w", p.Netns, err)
			}
			has := slices.ContainsFunc(rules, isReturnRule)
			routes, err := h.RouteListFiltered(fam, &netlink.Route{Table: ReturnTable}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return fmt.Errorf("netns %s: list routes of table %d: %w", p.Netns, ReturnTable, err)
			}
			local := false
			for _, r := range routes {
				if isReturnRoute(h, r) {
					local = true
				} else {
					p.OtherRoutes = append(p.OtherRoutes, r.String())
				}
			}
			if fam == unix.AF_INET {
				p.Rule4, p.Route4 = has, local
			} else {
				p.Rule6, p.Route6 = has, local
			}
		}
		return nil
	})
}

func isReturnRule(r netlink.Rule) bool {
	return r.Priority == ReturnRulePref && r.Table == ReturnTable && r.Mark == ReturnMark && r.Mask != nil && *r.Mask == ReturnMask
}

func isReturnRoute(h *netlink.Handle, r netlink.Route) bool {
	if r.Type != unix.RTN_LOCAL || r.Dst == nil {
		return false
	}
	if ones, _ := r.Dst.Mask.Size(); ones != 0 {
		return false
	}
	l, err := h.LinkByIndex(r.LinkIndex)
	return err == nil && l.Attrs().Name == "lo"
}

// RemoveOptions say what Remove leaves.
type RemoveOptions struct {
	// KeepReturnPath leaves the policy rule and table 100's routes: the
	// eBPF enrolment installs the very same ones (R10), so a takeover that
	// enrolled first must keep them.
	KeepReturnPath bool
}

// RemovePod takes istio-cni's state out of the pod netns at path, and only
// it: in each iptables backend and family the rules jumping into
// ISTIO_PRERT/ISTIO_OUTPUT, then those chains (per table in one
// iptables-restore --noflush, so each table changes atomically); its
// istio-ambient-* nftables tables (one nft transaction); and, unless
// o.KeepReturnPath, its policy rule and its two local routes. What is
// already gone is skipped, so it may run again. Errors name the netns,
// table and command.
func (mgr *RuleManager) RemovePod(ctx context.Context, path string, o RemoveOptions) error {
	err := inNetns(path, func() error {
		var errs []error
		for _, t := range mgr.iptables {
			errs = append(errs, removeChains(ctx, path, t, podChains))
		}
		if mgr.nft != "" {
			errs = append(errs, mgr.deleteNftTables(ctx, path, []string{NftNatTable, NftMangleTable, NftRawTable}))
		}
		if !o.KeepReturnPath {
			errs = append(errs, removeReturnPath(path))
		}
		return errors.Join(errs...)
	})
	return err
}

// removeChains deletes the jumps into the chains and the chains, in the
// tables of the thread's netns that have them.
func removeChains(ctx context.Context, where string, t tools, names []string) error {
	out, err := run(ctx, where, "", t.save)
	if err != nil {
		return err
	}
	s, err := ParseSave(out)
	if err != nil {
		return fmt.Errorf("netns %s: parse %s output: %w", where, t.save, err)
	}
	var errs []error
	for _, tb := range s.Tables {
		var del, flush, drop []string
		for _, r := range tb.Rules {
			if !slices.Contains(names, r.Chain) && slices.Contains(names, r.Target()) {
				del = append(del, "-D "+r.Chain+" "+r.Spec)
			}
		}
		for _, c := range tb.Chains {
			if slices.Contains(names, c.Name) {
				flush = append(flush, "-F "+c.Name)
				drop = append(drop, "-X "+c.Name)
			}
		}
		if len(del)+len(flush) == 0 {
			continue
		}
		script := "*" + tb.Name + "\n" + strings.Join(slices.Concat(del, flush, drop), "\n") + "\nCOMMIT\n"
		if _, err := run(ctx, where, script, t.restore, "--noflush"); err != nil {
			errs = append(errs, fmt.Errorf("table %s: %w", tb.Name, err))
		}
	}
	return errors.Join(errs...)
}

func removeReturnPath(where string) error {
	h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("netns %s: netlink: %w", where, err)
	}
	defer h.Close()
	var errs []error
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := h.RuleList(fam)
		if err != nil {
			return fmt.Errorf("netns %s: list rules: %w", where, err)
		}
		for _, r := range rules {
			if isReturnRule(r) {
				if err := h.RuleDel(&r); err != nil && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("netns %s: ip rule del fwmark 0x111/0xfff pref 32764 lookup 100 (family %d): %w", where, fam, err))
				}
			}
		}
		routes, err := h.RouteListFiltered(fam, &netlink.Route{Table: ReturnTable}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("netns %s: list routes of table %d: %w", where, ReturnTable, err)
		}
		for _, r := range routes {
			if isReturnRoute(h, r) {
				if err := h.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
					errs = append(errs, fmt.Errorf("netns %s: ip route del local %s dev lo table 100: %w", where, r.Dst, err))
				}
			}
		}
	}
	return errors.Join(errs...)
}
