// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// istioCharts is the charts directory of the istio.io/istio module this
// repository requires (go.mod), from the module cache.
func istioCharts(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}", "istio.io/istio").Output()
	dir := strings.TrimSpace(string(out))
	if err != nil || dir == "" {
		testenv.SkipOrFail(t, "istio.io/istio is not in the module cache (go mod download): %v", err)
	}
	return filepath.Join(dir, "manifests", "charts")
}

// renderIstioChart renders one of Istio's charts as `helm template` with
// --set flags does, and returns its files.
func renderIstioChart(t *testing.T, dir string, sets ...string) map[string]string {
	t.Helper()
	ch, err := loader.Load(dir)
	if err != nil {
		t.Fatalf("load %s: %v", dir, err)
	}
	vals := map[string]any{}
	for _, s := range sets {
		if err := strvals.ParseInto(s, vals); err != nil {
			t.Fatal(err)
		}
	}
	top, err := chartutil.ToRenderValues(ch, vals, chartutil.ReleaseOptions{Name: ch.Name(), Namespace: releaseNS, IsInstall: true},
		chartutil.DefaultCapabilities.Copy())
	if err != nil {
		t.Fatalf("values of %s: %v", ch.Name(), err)
	}
	files, err := engine.Render(ch, top)
	if err != nil {
		t.Fatalf("render %s: %v", ch.Name(), err)
	}
	return files
}

// The README's "Install next to Istio" with Helm, checked against Istio's
// own charts at the version go.mod names: istiod's ambient profile without
// the istio-cni chart injects sidecars with istio-init (they need no
// istio-cni), and ztunnel looks for the ZDS socket where the chart's agent
// serves it.
func TestInstallNextToIstio(t *testing.T) {
	charts := istioCharts(t)

	files := renderIstioChart(t, filepath.Join(charts, "istio-control", "istio-discovery"), "profile=ambient")
	var injector corev1.ConfigMap
	if err := yaml.Unmarshal([]byte(files["istiod/templates/istiod-injector-configmap.yaml"]), &injector); err != nil {
		t.Fatal(err)
	}
	var values struct {
		Pilot struct {
			CNI struct {
				Enabled bool `json:"enabled"`
			} `json:"cni"`
		} `json:"pilot"`
	}
	if err := json.Unmarshal([]byte(injector.Data["values"]), &values); err != nil {
		t.Fatalf("sidecar injector values: %v\n%s", err, injector.Data["values"])
	}
	if values.Pilot.CNI.Enabled {
		t.Error("istiod --set profile=ambient injects sidecars for istio-cni (pilot.cni.enabled): without it their iptables would be nobody's")
	}

	files = renderIstioChart(t, filepath.Join(charts, "ztunnel"), "profile=ambient")
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal([]byte(files["ztunnel/templates/daemonset.yaml"]), &ds); err != nil {
		t.Fatal(err)
	}
	ours, err := renderChart("")
	if err != nil {
		t.Fatal(err)
	}
	zds := flag1(t, ours.agent(t), "zds-socket")
	found := false
	for _, c := range ds.Spec.Template.Spec.Containers {
		for _, m := range c.VolumeMounts {
			for _, v := range ds.Spec.Template.Spec.Volumes {
				if v.Name == m.Name && v.HostPath != nil && filepath.Dir(zds) == v.HostPath.Path && m.MountPath == v.HostPath.Path {
					found = true
				}
			}
		}
	}
	if !found || filepath.Base(zds) != "ztunnel.sock" {
		t.Errorf("ztunnel does not mount the host directory of --zds-socket=%s at the same path", zds)
	}
}

// istio-cni's default ambient.enablementSelectors, taken from its chart as
// they are, reach our agent as the label rule it decides by without them.
func TestIstioCNIDefaultEnablementSelectors(t *testing.T) {
	ch, err := loader.Load(filepath.Join(istioCharts(t), "istio-cni"))
	if err != nil {
		t.Fatal(err)
	}
	sel, err := chartutil.Values(ch.Values).PathValue("_internal_defaults_do_not_set.ambient.enablementSelectors")
	if err != nil {
		t.Fatalf("istio-cni's chart has no ambient.enablementSelectors: %v", err)
	}
	values, err := yaml.Marshal(map[string]any{"ambient": map[string]any{"enablementSelectors": sel}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := renderChart(string(values))
	if err != nil {
		t.Fatal(err)
	}
	if got := agentConfig(t, r).Enrollment.Selectors; !reflect.DeepEqual(got, enrollment.DefaultSelectors()) {
		t.Errorf("istio-cni's default selectors reach the agent as %+v, want %+v", got, enrollment.DefaultSelectors())
	}
	dryRun(t, r)
}
