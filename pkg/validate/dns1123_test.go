// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package validate

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation"
)

// dns1123Cases are names at the rules' edges: lengths, dots, dashes, case
// and bytes outside ASCII.
var dns1123Cases = []string{
	"", "a", "0", "-", "a-", "-a", "a-b", "a--b", "a.b", ".a", "a.", "a..b", "a.-b", "a-.b", "A", "aB",
	"kube-system", "web-7d4b9c-x2x9z", "web.v2", "1.2.3", "a_b", "a b", "ünï", "\xff", "a\x00",
	strings.Repeat("n", 63), strings.Repeat("n", 64), strings.Repeat("a", 253), strings.Repeat("a", 254),
	strings.Repeat("a", 63) + "." + strings.Repeat("b", 63), strings.Repeat("a", 64) + ".b",
	strings.Repeat("a.", 126) + "a", strings.Repeat("a.", 127),
}

// checkDNS1123 fails when the local rules and Kubernetes' disagree on s.
func checkDNS1123(t *testing.T, s string) {
	t.Helper()
	if ours, theirs := dns1123Label(s) == "", len(validation.IsDNS1123Label(s)) == 0; ours != theirs {
		t.Errorf("label %q: accepted here %v, by Kubernetes %v", s, ours, theirs)
	}
	if ours, theirs := dns1123Subdomain(s) == "", len(validation.IsDNS1123Subdomain(s)) == 0; ours != theirs {
		t.Errorf("subdomain %q: accepted here %v, by Kubernetes %v", s, ours, theirs)
	}
}

func TestDNS1123AgreesWithKubernetes(t *testing.T) {
	for _, s := range dns1123Cases {
		checkDNS1123(t, s)
	}
}

func FuzzDNS1123(f *testing.F) {
	for _, s := range dns1123Cases {
		f.Add(s)
	}
	f.Fuzz(checkDNS1123)
}
