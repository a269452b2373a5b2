// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/ambient-ebpf/ambient-ebpf/"

// deps returns the module's packages pkg depends on, directly or not, as
// go list -deps reports them.
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", module+pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	var ours []string
	for _, p := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(p, module); ok && rest != pkg {
			ours = append(ours, rest)
		}
	}
	return ours
}

// The control plane's rooms and arrows: sources -> reconciler ->
// {dataplane, zds}; the status writer (pkg/kube) listens to the
// reconciler; nothing points back from the reconciler, or from what it
// drives, into a source or a listener. The CLI and doctor read the pins
// through pkg/dataplane/inspect, never linking the runtime loader
// pkg/dataplane.
func TestImportGraph(t *testing.T) {
	sources := []string{"pkg/kube", "pkg/standalone", "pkg/cni/events", "pkg/agent"}
	cases := []struct {
		pkg      string
		needs    []string
		mustNot  []string
		whyNeeds string
	}{
		{"pkg/reconciler", []string{"pkg/dataplane", "pkg/zds", "pkg/enrollment"}, sources,
			"the reconciler drives the data path and ZDS with pkg/enrollment's rules"},
		{"pkg/kube", []string{"pkg/reconciler"}, []string{"pkg/standalone", "pkg/cni/events", "pkg/agent"},
			"the informers report to the reconciler and the status writer listens to it"},
		{"pkg/standalone", []string{"pkg/reconciler"}, []string{"pkg/kube", "pkg/cni/events", "pkg/agent"},
			"the pod file reports to the reconciler"},
		{"pkg/dataplane", nil, append([]string{"pkg/reconciler", "pkg/zds"}, sources...), ""},
		// The layout upgrade is handed what it needs by the runtime and
		// never calls it.
		{"pkg/dataplane/upgrade", nil, append([]string{"pkg/dataplane", "pkg/reconciler", "pkg/zds"}, sources...), ""},
		// The read-only views sit below the runtime loader (dataplane ->
		// inspect -> bpfobj), and their readers link only them.
		{"pkg/dataplane/inspect", nil, append([]string{"pkg/dataplane", "pkg/reconciler", "pkg/zds"}, sources...), ""},
		{"pkg/dataplane/bpfobj", nil, []string{"pkg/dataplane", "pkg/dataplane/inspect", "pkg/dataplane/upgrade", "pkg/dataplane/accel"}, ""},
		{"pkg/dataplane/accel", nil, append([]string{"pkg/dataplane", "pkg/dataplane/inspect", "pkg/dataplane/upgrade", "pkg/reconciler", "pkg/zds"}, sources...), ""},
		{"pkg/cli", []string{"pkg/dataplane/inspect"}, []string{"pkg/dataplane", "pkg/reconciler"},
			"the CLI reads the pins through the views"},
		{"pkg/doctor", []string{"pkg/dataplane/inspect"}, []string{"pkg/dataplane", "pkg/reconciler"},
			"doctor reads the pins through the views"},
		{"pkg/zds", nil, append([]string{"pkg/reconciler", "pkg/dataplane"}, sources...), ""},
		{"pkg/enrollment", nil, append([]string{"pkg/reconciler", "pkg/dataplane", "pkg/zds"}, sources...), ""},
	}
	for _, tc := range cases {
		t.Run(tc.pkg, func(t *testing.T) {
			got := deps(t, tc.pkg)
			for _, n := range tc.needs {
				if !slices.Contains(got, n) {
					t.Errorf("%s does not import %s (%s)", tc.pkg, n, tc.whyNeeds)
				}
			}
			for _, n := range tc.mustNot {
				if slices.Contains(got, n) {
					t.Errorf("%s depends on %s: an arrow back against the layers", tc.pkg, n)
				}
			}
		})
	}
	// The sources report and listen; they never drive the data path or
	// ZDS themselves.
	for _, src := range []string{"pkg/kube", "pkg/standalone"} {
		for _, driven := range []string{"pkg/dataplane", "pkg/zds"} {
			if direct := directImports(t, src); slices.Contains(direct, driven) {
				t.Errorf("source %s imports %s directly; it must go through the reconciler", src, driven)
			}
		}
	}
}

func directImports(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-f", `{{join .Imports "\n"}}`, module+pkg).Output()
	if err != nil {
		t.Fatalf("go list %s: %v", pkg, err)
	}
	var ours []string
	for _, p := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(p, module); ok {
			ours = append(ours, rest)
		}
	}
	return ours
}

// The CNI plugins run once per pod start, so they link only what a CNI
// call needs: never the BPF loader (cilium/ebpf and the objects embedded
// in pkg/dataplane) nor the agent's control plane. The fallback reads the
// pod file through the leaf pkg/podfile.
func TestCNIPluginsLinkNoLoader(t *testing.T) {
	for _, bin := range []string{"cmd/ambient-ebpf-cni", "cmd/ambient-ebpf-cni-fallback"} {
		for _, p := range linked(t, bin) {
			for _, banned := range []string{"github.com/cilium/ebpf", module + "pkg/dataplane", module + "pkg/reconciler", module + "pkg/standalone", module + "pkg/zds"} {
				if p == banned || strings.HasPrefix(p, banned+"/") {
					t.Errorf("%s links %s", bin, p)
				}
			}
		}
	}
}

// The chained plugin's start is most of a CNI ADD, so it talks to the agent
// in pkg/api/cniv1's small frames and links no gRPC, protobuf or HTTP/2
// (issue 36); only the inspection API, which the plugin never calls, keeps
// gRPC. Nor Kubernetes' libraries, whose initialisers (klog,
// apimachinery's validation) took 6% of its CPU per ADD. The fallback,
// which runs only while the agent is down, may link more.
func TestCNIPluginLinksLittle(t *testing.T) {
	const bin = "cmd/ambient-ebpf-cni"
	for _, p := range linked(t, bin) {
		for _, banned := range []string{"google.golang.org/grpc", "google.golang.org/protobuf", "golang.org/x/net/http2", "k8s.io"} {
			if p == banned || strings.HasPrefix(p, banned+"/") {
				t.Errorf("%s links %s", bin, p)
			}
		}
	}
}

// linked returns every package the module's main package bin links, the
// standard library's included.
func linked(t *testing.T, bin string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", module+bin).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", bin, err)
	}
	return strings.Fields(string(out))
}
