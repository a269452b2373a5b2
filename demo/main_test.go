// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func TestMain(m *testing.M) {
	simnode.RunHelper()
	os.Exit(m.Run())
}

// The demo (the README's first command) runs end to end and says what the
// README promises: pods through the CNI chain, traffic through ztunnel, the
// probe from the node's own address, the DNS answer, the decoded maps; and it cleans
// up.
func TestDemoRunsAndCleansUp(t *testing.T) {
	testenv.RequireRoot(t)
	plugins := os.Getenv("CNI_PLUGINS_DIR")
	if plugins == "" {
		plugins = "../.cache/cni-plugins/v1.10.0"
	}
	if _, err := os.Stat(filepath.Join(plugins, "ptp")); err != nil {
		testenv.SkipOrFail(t, "CNI reference plugins not built (make cni-plugins): %v", err)
	}
	bin := t.TempDir()
	for _, cmd := range []string{"ambient-ebpf-agent", "ambient-ebpf-cni", "ambient-ebpf-cni-fallback", "ambient-ebpf"} {
		simnode.BuildBinary(t, bin, "github.com/ambient-ebpf/ambient-ebpf/cmd/"+cmd)
	}
	var out strings.Builder
	if code := run(&out, bin, plugins, "pods.yaml"); code != 0 {
		t.Fatalf("demo exited %d:\n%s", code, out.String())
	}
	for _, want := range []string{
		"conflist 10-demo.conflist: ptp -> ambient-ebpf-cni",
		"shop/frontend", "enrolled before its app starts",
		"legacy/batch", "passes through",
		`reached "backend", which saw the client as 198.18.100.2; via ztunnel :15001, original destination 198.18.100.3:8080 (SO_ORIGINAL_DST)`,
		"via ztunnel :15001, original destination 198.19.0.2:8080",
		"which saw the client as 198.18.100.1; not through ztunnel; the probe kept the node's own address (direct host probes)",
		"answered by ztunnel's DNS proxy (:15053); the app saw the reply come from 198.19.0.2:53",
		"ae_pods (4)", "ae_probe_nat",
		"agent stopped; no pins left",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("demo output:\n%s", out.String())
	}
}
