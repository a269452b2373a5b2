// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/agent"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
)

// schemaEnum returns the enum values.schema.json gives the value at path
// (property names).
func schemaEnum(t *testing.T, path ...string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var node map[string]any
	if err := json.Unmarshal(b, &node); err != nil {
		t.Fatal(err)
	}
	for _, p := range path {
		props, _ := node["properties"].(map[string]any)
		if node, _ = props[p].(map[string]any); node == nil {
			t.Fatalf("values.schema.json has no %s", strings.Join(path, "."))
		}
	}
	enum, ok := node["enum"].([]any)
	if !ok {
		t.Fatalf("values.schema.json gives %s no enum", strings.Join(path, "."))
	}
	var out []string
	for _, v := range enum {
		out = append(out, v.(string))
	}
	return out
}

// agentFlagSet is the agent's command line as cmd/ambient-ebpf-agent
// registers it.
func agentFlagSet() (*flag.FlagSet, *agent.Flags) {
	fs := flag.NewFlagSet("ambient-ebpf-agent", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs, agent.NewFlags(fs)
}

// Every log level and format the schema lets through is one the agent
// takes.
func TestValuesAreWhatTheAgentAccepts(t *testing.T) {
	for _, level := range schemaEnum(t, "agent", "logLevel") {
		fs, f := agentFlagSet()
		if err := fs.Parse([]string{"--log-level=" + level}); err != nil {
			t.Fatal(err)
		}
		if _, err := f.Logger(); err != nil {
			t.Errorf("agent.logLevel %q passes the schema, the agent refuses it: %v", level, err)
		}
	}
	for _, format := range schemaEnum(t, "agent", "logFormat") {
		if format == "" {
			continue // the chart's default: from global.logAsJson
		}
		fs, f := agentFlagSet()
		if err := fs.Parse([]string{"--log-format=" + format}); err != nil {
			t.Fatal(err)
		}
		if _, err := f.Logger(); err != nil {
			t.Errorf("agent.logFormat %q passes the schema, the agent refuses it: %v", format, err)
		}
	}
}

// Every sockmap acceleration mode the schema lets through is one the agent
// takes.
func TestSockmapAccelValuesAreAgentModes(t *testing.T) {
	for _, mode := range schemaEnum(t, "agent", "sockmapAccel") {
		if _, err := accel.ParseMode(mode); err != nil {
			t.Errorf("agent.sockmapAccel %q passes the schema, the agent refuses it: %v", mode, err)
		}
	}
}

// Every hand-back backend the schema lets through is one the agent takes.
func TestIstioCNIHandBackValuesAreAgentBackends(t *testing.T) {
	for _, b := range schemaEnum(t, "agent", "istioCNI", "handBack") {
		fs, f := agentFlagSet()
		if err := fs.Parse([]string{"--istio-cni-handback=" + b, "--cgroup-root=" + t.TempDir(), "--install-cni=false"}); err != nil {
			t.Fatal(err)
		}
		if _, err := f.Config(); err != nil {
			t.Errorf("agent.istioCNI.handBack %q passes the schema, the agent refuses it: %v", b, err)
		}
	}
}

// The chart works as a subchart of an umbrella chart that sets Istio's
// globals: Helm validates our schema against the values it passes down,
// globals included.
func TestChartAsSubchartWithIstioGlobals(t *testing.T) {
	sub, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	parent := &chart.Chart{
		Metadata: &chart.Metadata{APIVersion: chart.APIVersionV2, Name: "mesh", Version: "1.0.0",
			Dependencies: []*chart.Dependency{{Name: sub.Name(), Version: sub.Metadata.Version}}},
		Values: map[string]any{
			"global":   map[string]any{"hub": "docker.io/istio", "tag": "1.27.1", "logAsJson": true, "istioNamespace": "istio-system"},
			sub.Name(): map[string]any{"agent": map[string]any{"logLevel": "debug"}},
		},
	}
	parent.AddDependency(sub)
	top, err := chartutil.ToRenderValues(parent, map[string]any{},
		chartutil.ReleaseOptions{Name: "mesh", Namespace: releaseNS, Revision: 1, IsInstall: true}, chartutil.DefaultCapabilities.Copy())
	if err != nil {
		t.Fatalf("values of the umbrella chart: %v", err)
	}
	files, err := engine.Engine{Strict: true}.Render(parent, top)
	if err != nil {
		t.Fatalf("render as a subchart: %v", err)
	}
	ds := files["mesh/charts/ambient-ebpf/templates/daemonset.yaml"]
	if !strings.Contains(ds, "--log-level=debug") {
		t.Errorf("subchart DaemonSet lacks its own values:\n%s", ds)
	}
}

// agentConfig parses the rendered agent's arguments with the agent's own
// flags and builds its Config, as the agent would on start.
func agentConfig(t *testing.T, r *rendered) agent.Config {
	t.Helper()
	fs, f := agentFlagSet()
	if err := fs.Parse(r.agent(t).Args); err != nil {
		t.Fatalf("the agent refuses the rendered arguments: %v", err)
	}
	if fs.NArg() != 0 {
		t.Fatalf("rendered arguments the agent does not take as flags: %v", fs.Args())
	}
	cfg, err := f.Config()
	if err != nil {
		t.Fatalf("the agent refuses the rendered flags: %v", err)
	}
	return cfg
}
