// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// nftTables lists the inet tables of the thread's netns among names.
func (mgr *RuleManager) nftTables(ctx context.Context, where string, names []string) ([]string, error) {
	out, err := run(ctx, where, "", mgr.nft, "list", "tables", "inet")
	if err != nil {
		return nil, err
	}
	var have []string
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "table" && f[1] == "inet" && slices.Contains(names, f[2]) {
			have = append(have, f[2])
		}
	}
	return have, nil
}

// listNft returns `nft list table inet NAME` of each of the named tables
// the thread's netns has, in the order given; "" when it has none. It
// reads them in one `nft list ruleset inet`, a consistent snapshot: a
// table listed, then deleted by someone else before a listing of its own
// (an agent taking the pod over), failed the read.
func (mgr *RuleManager) listNft(ctx context.Context, where string, names []string) (string, error) {
	out, err := run(ctx, where, "", mgr.nft, "list", "ruleset", "inet")
	if err != nil {
		return "", err
	}
	blocks := nftTableBlocks(out)
	var b strings.Builder
	for _, name := range names {
		b.WriteString(blocks[name])
	}
	return b.String(), nil
}

// nftTableBlocks splits nft's listing of inet tables into each table's
// block ("table inet NAME {" to its closing "}" line, newline included),
// by name.
func nftTableBlocks(out string) map[string]string {
	blocks := map[string]string{}
	var name string
	var cur strings.Builder
	for _, line := range strings.SplitAfter(out, "\n") {
		if f := strings.Fields(line); name == "" && len(f) == 4 && f[0] == "table" && f[1] == "inet" && f[3] == "{" {
			name = f[2]
			cur.Reset()
		}
		if name == "" {
			continue
		}
		cur.WriteString(line)
		if strings.TrimRight(line, "\n") == "}" {
			blocks[name] = cur.String()
			name = ""
		}
	}
	return blocks
}

// deleteNftTables deletes those of the named inet tables that exist, in
// one transaction.
func (mgr *RuleManager) deleteNftTables(ctx context.Context, where string, names []string) error {
	have, err := mgr.nftTables(ctx, where, names)
	if err != nil || len(have) == 0 {
		return err
	}
	var script strings.Builder
	for _, name := range have {
		fmt.Fprintf(&script, "delete table inet %s\n", name)
	}
	if _, err := run(ctx, where, script.String(), mgr.nft, "-f", "-"); err != nil {
		return fmt.Errorf("tables %s: %w", strings.Join(have, ", "), err)
	}
	return nil
}

// canonicalNft applies script in a scratch netns and lists istio-cni's
// tables back, as the installed nft prints them.
func (mgr *RuleManager) canonicalNft(ctx context.Context, script string) (string, error) {
	key := "nft\x00" + script
	mgr.mu.Lock()
	out, ok := mgr.canon[key]
	mgr.mu.Unlock()
	if ok {
		return out, nil
	}
	err := inScratchNetns(func() error {
		if _, err := run(ctx, "scratch", script, mgr.nft, "-f", "-"); err != nil {
			return err
		}
		var err error
		out, err = mgr.listNft(ctx, "scratch", []string{NftNatTable, NftMangleTable, NftRawTable})
		return err
	})
	if err != nil {
		return "", fmt.Errorf("render the expected nftables tables: %w", err)
	}
	mgr.mu.Lock()
	mgr.canon[key] = out
	mgr.mu.Unlock()
	return out, nil
}

var nftCounter = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// nftLines is nft list output for comparison: counters dropped, one
// trimmed statement a line.
func nftLines(out string) []string {
	var lines []string
	for _, l := range strings.Split(nftCounter.ReplaceAllString(out, "counter"), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			lines = append(lines, l)
		}
	}
	return lines
}

// nftOptions reads the options off istio-cni's nat table as nft lists it.
func nftOptions(out string) podopts.Options {
	var o podopts.Options
	inbound := false
	chain := ""
	for _, l := range nftLines(out) {
		f := strings.Fields(l)
		if len(f) >= 2 && f[0] == "chain" {
			chain = f[1]
			continue
		}
		if chain == "istio-prerouting" && strings.Contains(l, "redirect to :15006") {
			inbound = true
		}
		if chain == "istio-prerouting" && strings.Contains(l, "redirect to :15001") {
			if i := slices.Index(f, "iifname"); i >= 0 && i+1 < len(f) {
				o.RerouteInterfaces = append(o.RerouteInterfaces, strings.Trim(f[i+1], `"`))
			}
		}
		if chain == "istio-output" && strings.Contains(l, "redirect to :15053") {
			o.DNSCapture = true
		}
	}
	o.BypassInbound = !inbound
	return o
}
