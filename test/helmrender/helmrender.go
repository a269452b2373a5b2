// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package helmrender renders a Helm chart as `helm template` does and
// decodes the documents of chosen templates into Kubernetes objects, for
// the suites that run a chart's workload themselves: test/node (our chart)
// and test/istiocnireal (Istio's istio-cni chart).
package helmrender

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// Release is how a chart is installed.
type Release struct {
	Name, Namespace string
	// Strict fails on a value the templates read that is not set, as
	// our chart wants; Istio's charts read unset values.
	Strict bool
}

// Render renders the chart at dir for rel, with values (YAML) over its
// values.yaml, and decodes the documents of the named templates (file
// names under templates/), in order; an unknown kind or field fails.
func Render(dir string, rel Release, values string, templates ...string) ([]k8sruntime.Object, error) {
	ch, err := loader.Load(dir)
	if err != nil {
		return nil, fmt.Errorf("load chart %s: %w", dir, err)
	}
	vals, err := chartutil.ReadValues([]byte(values))
	if err != nil {
		return nil, fmt.Errorf("read values of chart %s: %w", dir, err)
	}
	top, err := chartutil.ToRenderValues(ch, vals,
		chartutil.ReleaseOptions{Name: rel.Name, Namespace: rel.Namespace, Revision: 1, IsInstall: true}, chartutil.DefaultCapabilities.Copy())
	if err != nil {
		return nil, fmt.Errorf("render values of chart %s: %w", dir, err)
	}
	files, err := engine.Engine{Strict: rel.Strict}.Render(ch, top)
	if err != nil {
		return nil, fmt.Errorf("render chart %s: %w", dir, err)
	}
	s := k8sruntime.NewScheme()
	for _, add := range []func(*k8sruntime.Scheme) error{appsv1.AddToScheme, corev1.AddToScheme, rbacv1.AddToScheme} {
		if err := add(s); err != nil {
			return nil, err
		}
	}
	dec := serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
	var objs []k8sruntime.Object
	for _, name := range templates {
		rd := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(files[filepath.Join(ch.Name(), "templates", name)])))
		for {
			doc, err := rd.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
			var probe map[string]any
			if err := yaml.Unmarshal(doc, &probe); err != nil || len(probe) == 0 {
				continue
			}
			obj, _, err := dec.Decode(doc, nil, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: decode: %w", name, err)
			}
			objs = append(objs, obj)
		}
	}
	return objs, nil
}

// DaemonSet is the first DaemonSet of objs, or nil.
func DaemonSet(objs []k8sruntime.Object) *appsv1.DaemonSet {
	for _, o := range objs {
		if ds, ok := o.(*appsv1.DaemonSet); ok {
			return ds
		}
	}
	return nil
}
