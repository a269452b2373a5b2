// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import "testing"

// nft's listing of several inet tables splits into each table's block,
// as `nft list table inet NAME` prints it.
func TestNftTableBlocks(t *testing.T) {
	out := "table inet istio-ambient-nat {\n\tchain output {\n\t\ttype nat hook output priority dstnat; policy accept;\n\t}\n}\n" +
		"table inet other {\n}\n" +
		"table inet istio-ambient-raw {\n\tset s {\n\t\ttype ipv4_addr\n\t}\n}\n"
	got := nftTableBlocks(out)
	want := map[string]string{
		"istio-ambient-nat": "table inet istio-ambient-nat {\n\tchain output {\n\t\ttype nat hook output priority dstnat; policy accept;\n\t}\n}\n",
		"other":             "table inet other {\n}\n",
		"istio-ambient-raw": "table inet istio-ambient-raw {\n\tset s {\n\t\ttype ipv4_addr\n\t}\n}\n",
	}
	if len(got) != len(want) {
		t.Fatalf("blocks %q", got)
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s: %q, want %q", name, got[name], w)
		}
	}
	if b := nftTableBlocks(""); len(b) != 0 {
		t.Errorf("empty listing: %q", b)
	}
}
