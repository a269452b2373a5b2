// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"fmt"
	"strings"
)

// Save is iptables-save output, parsed: per table its chains and rules in
// the order the kernel holds them.
type Save struct {
	Tables []*Table
}

// Table is one "*name ... COMMIT" block.
type Table struct {
	Name   string
	Chains []Chain
	Rules  []Rule
}

// Chain is a ":NAME POLICY [p:b]" line; Policy is "-" for a user chain.
type Chain struct {
	Name, Policy string
}

// Rule is an "-A CHAIN SPEC" line: Spec is the rule as iptables-save
// prints it, which iptables reads back unchanged (-D CHAIN SPEC).
type Rule struct {
	Chain, Spec string
}

// Target is the chain or target the rule jumps or goes to ("" for none).
func (r Rule) Target() string {
	f := strings.Fields(r.Spec)
	for i := 0; i+1 < len(f); i++ {
		if f[i] == "-j" || f[i] == "-g" || f[i] == "--jump" || f[i] == "--goto" {
			return f[i+1]
		}
	}
	return ""
}

func (r Rule) String() string { return "-A " + r.Chain + " " + r.Spec }

// Table returns the table of that name, nil if the output has none.
func (s *Save) Table(name string) *Table {
	for _, t := range s.Tables {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// HasChain says whether the table declares the chain.
func (t *Table) HasChain(name string) bool {
	for _, c := range t.Chains {
		if c.Name == name {
			return true
		}
	}
	return false
}

// ParseSave parses iptables-save (or ip6tables-save) output, either
// backend. Comment lines are skipped; counters ("-c" or "[p:b]") are
// dropped. Anything else out of place is an error naming the line.
func ParseSave(out string) (*Save, error) {
	s := &Save{}
	var cur *Table
	for i, line := range strings.Split(out, "\n") {
		line = strings.TrimRight(line, "\r")
		n := i + 1
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "*"):
			if cur != nil {
				return nil, fmt.Errorf("line %d: table %q starts before table %s's COMMIT", n, line[1:], cur.Name)
			}
			name := line[1:]
			if name == "" || strings.ContainsAny(name, " \t") {
				return nil, fmt.Errorf("line %d: bad table name %q", n, name)
			}
			cur = &Table{Name: name}
		case line == "COMMIT":
			if cur == nil {
				return nil, fmt.Errorf("line %d: COMMIT outside a table", n)
			}
			s.Tables = append(s.Tables, cur)
			cur = nil
		case strings.HasPrefix(line, ":"):
			if cur == nil {
				return nil, fmt.Errorf("line %d: chain outside a table: %q", n, line)
			}
			f := strings.Fields(line[1:])
			if len(f) < 2 {
				return nil, fmt.Errorf("line %d: bad chain line %q", n, line)
			}
			cur.Chains = append(cur.Chains, Chain{Name: f[0], Policy: f[1]})
		case strings.HasPrefix(line, "-A ") || strings.HasPrefix(line, "[") && strings.Contains(line, "] -A "):
			if cur == nil {
				return nil, fmt.Errorf("line %d: rule outside a table: %q", n, line)
			}
			if strings.HasPrefix(line, "[") {
				line = line[strings.Index(line, "] -A ")+2:]
			}
			chain, spec, _ := strings.Cut(strings.TrimPrefix(line, "-A "), " ")
			if chain == "" {
				return nil, fmt.Errorf("line %d: rule without a chain: %q", n, line)
			}
			cur.Rules = append(cur.Rules, Rule{Chain: chain, Spec: strings.TrimSpace(spec)})
		default:
			return nil, fmt.Errorf("line %d: unexpected %q", n, line)
		}
	}
	if cur != nil {
		return nil, fmt.Errorf("table %s has no COMMIT", cur.Name)
	}
	return s, nil
}
