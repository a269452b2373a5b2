// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"path"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/strvals"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	chartDir    = "ambient-ebpf"
	releaseName = "ambient-ebpf"
	releaseNS   = "istio-system"
	// minKube is the oldest Kubernetes the chart declares (Chart.yaml).
	minKube = "v1.30.0"
)

// repeatableFlags are the agent's flags the chart may give more than once;
// the agent's own FlagSet says which flags exist (agentFlagSet).
var repeatableFlags = map[string]bool{"cni-bin-dir": true}

// rendered is one `helm template` of the chart, decoded.
type rendered struct {
	values   chartutil.Values
	kinds    []string // "<apiVersion> <kind>" in render order
	ds       *appsv1.DaemonSet
	sa       *corev1.ServiceAccount
	cr       *rbacv1.ClusterRole
	crb      *rbacv1.ClusterRoleBinding
	role     *rbacv1.Role
	rb       *rbacv1.RoleBinding
	pdb      *policyv1.PodDisruptionBudget
	quota    *corev1.ResourceQuota
	pm       *podMonitor
	manifest string
	notes    string
	docs     [][]byte // every object's YAML, for the API server
}

// podMonitor is the part of the Prometheus Operator's PodMonitor the chart
// renders, decoded strictly: a field outside it fails the test.
type podMonitor struct {
	APIVersion string            `json:"apiVersion"`
	Kind       string            `json:"kind"`
	Metadata   metav1.ObjectMeta `json:"metadata"`
	Spec       struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		PodMetricsEndpoints []struct {
			Port     string `json:"port"`
			Path     string `json:"path"`
			Interval string `json:"interval,omitempty"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// targetDecoder decodes strictly (unknown or duplicate fields are errors)
// into the typed objects of exactly the API versions the chart targets;
// any other group/version/kind fails to decode.
func targetDecoder() (runtime.Decoder, error) {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		appsv1.AddToScheme, corev1.AddToScheme, rbacv1.AddToScheme, policyv1.AddToScheme,
	} {
		if err := add(s); err != nil {
			return nil, fmt.Errorf("build scheme: %w", err)
		}
	}
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer(), nil
}

// renderChart renders the chart as `helm template` would, with the given
// values YAML over values.yaml, and decodes every object.
func renderChart(valuesYAML string) (*rendered, error) {
	return renderChartSchema(valuesYAML, true)
}

// renderChartSchema is renderChart with values.schema.json validation
// optional, as `helm template --skip-schema-validation` makes it, and
// --set flags applied over the values YAML as `helm template --set` does.
func renderChartSchema(valuesYAML string, validate bool, sets ...string) (*rendered, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, fmt.Errorf("load chart: %w", err)
	}
	overrides, err := chartutil.ReadValues([]byte(valuesYAML))
	if err != nil {
		return nil, fmt.Errorf("read values: %w", err)
	}
	for _, s := range sets {
		if err := strvals.ParseInto(s, overrides); err != nil {
			return nil, fmt.Errorf("--set %s: %w", s, err)
		}
	}
	// Render for the oldest Kubernetes we support, and refuse as Helm does
	// when Chart.yaml's kubeVersion excludes it.
	kv, err := chartutil.ParseKubeVersion(minKube)
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", minKube, err)
	}
	if !chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, kv.String()) {
		return nil, fmt.Errorf("chart kubeVersion %q excludes %s", ch.Metadata.KubeVersion, kv)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = *kv
	top, err := chartutil.ToRenderValuesWithSchemaValidation(ch, overrides,
		chartutil.ReleaseOptions{Name: releaseName, Namespace: releaseNS, Revision: 1, IsInstall: true}, caps, !validate)
	if err != nil {
		return nil, fmt.Errorf("render values: %w", err)
	}
	files, err := engine.Engine{Strict: true}.Render(ch, top)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	dec, err := targetDecoder()
	if err != nil {
		return nil, err
	}
	r := &rendered{values: top["Values"].(chartutil.Values), notes: files[path.Join(chartDir, "templates", "NOTES.txt")]}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	var all strings.Builder
	for _, name := range names {
		if path.Ext(name) != ".yaml" {
			continue // NOTES.txt, _helpers.tpl
		}
		fmt.Fprintf(&all, "---\n# Source: %s\n%s\n", name, files[name])
		if err := r.decodeFile(dec, name, files[name]); err != nil {
			return nil, err
		}
	}
	r.manifest = all.String()
	return r, nil
}

func (r *rendered) decodeFile(dec runtime.Decoder, name, text string) error {
	rd := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(text)))
	for {
		doc, err := rd.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: split documents: %w", name, err)
		}
		var probe map[string]any
		if err := yaml.Unmarshal(doc, &probe); err != nil {
			return fmt.Errorf("%s: parse: %w", name, err)
		}
		if len(probe) == 0 {
			continue // only comments or whitespace
		}
		r.docs = append(r.docs, doc)
		if probe["apiVersion"] == "monitoring.coreos.com/v1" && probe["kind"] == "PodMonitor" {
			var pm podMonitor
			if err := yaml.UnmarshalStrict(doc, &pm); err != nil {
				return fmt.Errorf("%s: decode PodMonitor strictly: %w\n%s", name, err, doc)
			}
			r.kinds = append(r.kinds, "monitoring.coreos.com/v1 PodMonitor")
			if err := setOnce(&r.pm, &pm); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			continue
		}
		obj, gvk, err := dec.Decode(doc, nil, nil)
		if err != nil {
			return fmt.Errorf("%s: decode strictly: %w\n%s", name, err, doc)
		}
		if err := r.add(obj, gvk); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
	}
}

func (r *rendered) add(obj runtime.Object, gvk *schema.GroupVersionKind) error {
	apiVersion, kind := gvk.ToAPIVersionAndKind()
	r.kinds = append(r.kinds, apiVersion+" "+kind)
	switch o := obj.(type) {
	case *appsv1.DaemonSet:
		return setOnce(&r.ds, o)
	case *corev1.ServiceAccount:
		return setOnce(&r.sa, o)
	case *rbacv1.ClusterRole:
		return setOnce(&r.cr, o)
	case *rbacv1.ClusterRoleBinding:
		return setOnce(&r.crb, o)
	case *rbacv1.Role:
		return setOnce(&r.role, o)
	case *rbacv1.RoleBinding:
		return setOnce(&r.rb, o)
	case *policyv1.PodDisruptionBudget:
		return setOnce(&r.pdb, o)
	case *corev1.ResourceQuota:
		return setOnce(&r.quota, o)
	}
	return fmt.Errorf("unexpected object %s %s", apiVersion, kind)
}

// setOnce keeps the one object of a kind the chart renders.
func setOnce[T any](dst **T, o *T) error {
	if *dst != nil {
		return fmt.Errorf("more than one %T", o)
	}
	*dst = o
	return nil
}

func (r *rendered) agent(t *testing.T) *corev1.Container {
	t.Helper()
	if r.ds == nil {
		t.Fatal("no DaemonSet rendered")
	}
	cs := r.ds.Spec.Template.Spec.Containers
	if len(cs) != 1 {
		t.Fatalf("DaemonSet has %d containers, want 1", len(cs))
	}
	return &cs[0]
}

// flags returns the agent's --name=value arguments by name.
func flags(t *testing.T, c *corev1.Container) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, a := range c.Args {
		name, val, ok := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.HasPrefix(a, "--") || !ok {
			t.Errorf("argument %q is not --flag=value", a)
			continue
		}
		out[name] = append(out[name], val)
	}
	return out
}

func flag1(t *testing.T, c *corev1.Container, name string) string {
	t.Helper()
	v := flags(t, c)[name]
	if len(v) != 1 {
		t.Fatalf("--%s given %d times, want once (%v)", name, len(v), c.Args)
	}
	return v[0]
}

// mounts maps each mount path to its mount and the volume behind it.
type mount struct {
	corev1.VolumeMount
	vol corev1.Volume
}

func mounts(t *testing.T, r *rendered) map[string]mount {
	t.Helper()
	vols := map[string]corev1.Volume{}
	for _, v := range r.ds.Spec.Template.Spec.Volumes {
		if _, dup := vols[v.Name]; dup {
			t.Errorf("volume %q defined twice", v.Name)
		}
		vols[v.Name] = v
	}
	out := map[string]mount{}
	for _, m := range r.agent(t).VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			t.Errorf("volumeMount %q has no volume", m.Name)
		}
		if _, dup := out[m.MountPath]; dup {
			t.Errorf("two mounts at %s", m.MountPath)
		}
		out[m.MountPath] = mount{m, v}
	}
	return out
}

// mountedAt returns the mount holding p (the longest mount path prefix).
func mountedAt(ms map[string]mount, p string) (mount, bool) {
	var best mount
	found := false
	for mp, m := range ms {
		if (p == mp || strings.HasPrefix(p, mp+"/")) && len(mp) > len(best.MountPath) {
			best, found = m, true
		}
	}
	return best, found
}

func valueBool(t *testing.T, r *rendered, key string) bool {
	t.Helper()
	v, err := r.values.PathValue(key)
	if err != nil {
		return false
	}
	b, _ := v.(bool)
	return b
}

// valueString is the string value at key, "" when unset.
func valueString(r *rendered, key string) string {
	v, err := r.values.PathValue(key)
	if err != nil {
		return ""
	}
	str, _ := v.(string)
	return str
}
