// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reference

import (
	"regexp"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// The reference leaves the state istio-cni leaves, and takes out only what
// istio-cni would: its chains and jumps in the pod (other rules stay), its
// policy rule and routes; on the node its ISTIO_POSTRT chain, jumped to
// from the top of POSTROUTING, and ipsets named as istio-cni names them.
// A takeover test starts from this state, so it must be exact.
func TestReferenceAppliesAndRemovesOnlyIstioCNIsRules(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("ref")
	pod, node := p.NetnsPath(), simnode.NetnsPath(n.NodeNS)
	// Someone else's rules, in the pod and on the node, before and after
	// istio-cni's: kube-proxy's and the primary CNI's kind.
	for _, ns := range []string{pod, node} {
		for _, tool := range []string{"iptables", "ip6tables"} {
			Run(t, ns, "*nat\n:KUBE-SERVICES - [0:0]\n-A OUTPUT -j KUBE-SERVICES\n-A POSTROUTING -j RETURN\nCOMMIT\n"+
				"*mangle\n:CNI-MARK - [0:0]\n-A PREROUTING -j CNI-MARK\nCOMMIT\n", tool+"-restore", "--noflush")
		}
	}
	save := func(ns string) string {
		var b strings.Builder
		for _, tool := range []string{"iptables-save", "ip6tables-save"} {
			// Counters and comments change; rules do not.
			out := Run(t, ns, "", tool)
			out = regexp.MustCompile(`(?m)^#.*\n`).ReplaceAllString(out, "")
			out = regexp.MustCompile(`\[\d+:\d+\]`).ReplaceAllString(out, "[0:0]")
			// A table someone used once stays listed, empty: not a rule.
			for _, table := range strings.SplitAfter(out, "COMMIT\n") {
				if strings.Contains(table, "\n-A ") || strings.Contains(table, " - [0:0]") {
					b.WriteString(table)
				}
			}
		}
		return b.String()
	}
	podBefore, nodeBefore := save(pod), save(node)
	rulesV4 := Run(t, pod, "", "ip", "-4", "rule", "show")

	var b Iptables
	b.Setup(t, n)
	b.Enroll(t, p, podopts.Options{DNSCapture: true})
	b.Enroll(t, p, podopts.Options{DNSCapture: true}) // istio-cni re-applies on reconcile: routes are replaced, not added twice

	podOn, nodeOn := save(pod), save(node)
	for _, want := range []string{"-A PREROUTING -j ISTIO_PRERT", "-A OUTPUT -j ISTIO_OUTPUT", ":ISTIO_PRERT", "REDIRECT --to-ports 15001", "-j CT --zone 1"} {
		if !strings.Contains(podOn, want) {
			t.Errorf("pod rules lack %q:\n%s", want, podOn)
		}
	}
	postrouting := regexp.MustCompile(`(?m)^-A POSTROUTING .*$`).FindAllString(nodeOn, -1)
	if len(postrouting) < 2 || postrouting[0] != "-A POSTROUTING -j ISTIO_POSTRT" {
		t.Errorf("POSTROUTING (v4) does not start with istio-cni's jump: %q", postrouting)
	}
	for _, want := range []string{"-A ISTIO_POSTRT -p tcp -m owner --socket-exists -m set --match-set " + rules.IpsetV4 + " dst -j SNAT --to-source " + rules.Probe4,
		"--match-set " + rules.IpsetV6 + " dst -j SNAT --to-source " + rules.Probe6} {
		if !strings.Contains(nodeOn, want) {
			t.Errorf("node rules lack %q:\n%s", want, nodeOn)
		}
	}
	for _, set := range []string{rules.IpsetV4, rules.IpsetV6} {
		if list := Run(t, node, "", "ipset", "list", set); !strings.Contains(list, `comment "`+p.UID+`"`) {
			t.Errorf("ipset %s lacks the pod:\n%s", set, list)
		}
	}
	if routes := Run(t, pod, "", "ip", "-4", "route", "show", "table", "100"); strings.Count(routes, "local default dev lo") != 1 {
		t.Errorf("table 100 after two enrolments: %q, want one local default route", routes)
	}

	b.Remove(t, p)
	if got := save(pod); got != podBefore {
		t.Errorf("pod rules after removal differ from before enrolment:\n got: %s\nwant: %s", got, podBefore)
	}
	if got := Run(t, pod, "", "ip", "-4", "rule", "show"); got != rulesV4 {
		t.Errorf("pod policy rules after removal:\n got: %s\nwant: %s", got, rulesV4)
	}
	if routes := Run(t, pod, "", "ip", "-4", "route", "show", "table", "100"); strings.TrimSpace(routes) != "" {
		t.Errorf("table 100 after removal: %q", routes)
	}
	for _, tool := range []string{"iptables", "ip6tables"} {
		for _, args := range rules.HostCleanup() {
			Run(t, node, "", append([]string{tool}, args...)...)
		}
	}
	if got := save(node); got != nodeBefore {
		t.Errorf("node rules after istio-cni's host cleanup differ from before:\n got: %s\nwant: %s", got, nodeBefore)
	}
}
