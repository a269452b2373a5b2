// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package standalone reads the pod file that stands in for the Kubernetes API
// on nodes and demos without a cluster. The file is a YAML (or JSON) stream
// of v1 Namespace and Pod objects, exactly as the API would serve them:
//
//	apiVersion: v1
//	kind: Namespace
//	metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient}}
//	---
//	apiVersion: v1
//	kind: Pod
//	metadata: {name: web, namespace: demo, uid: 7f0c...}
//	spec: {serviceAccountName: web, nodeName: node-1}
//
// The agent's standalone source and the CNI plugin's fallback both read it.
package standalone

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	corev1 "k8s.io/api/core/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// File is the parsed content of a pod file.
type File struct {
	Namespaces map[string]*corev1.Namespace
	Pods       []*corev1.Pod
}

// Pod returns the pod with the given namespace and name, or nil.
func (f *File) Pod(namespace, name string) *corev1.Pod {
	for _, p := range f.Pods {
		if p.Namespace == namespace && p.Name == name {
			return p
		}
	}
	return nil
}

// Load reads and parses the pod file at path.
func Load(path string) (*File, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open pod file: %w", err)
	}
	defer fh.Close()
	f, err := Parse(fh)
	if err != nil {
		return nil, fmt.Errorf("pod file %s: %w", path, err)
	}
	return f, nil
}

type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

// Parse reads a YAML or JSON stream of Namespace and Pod objects. Unknown
// kinds, missing names and duplicate pods are refused with the document's
// position, so a typo never silently drops a pod out of the mesh.
func Parse(r io.Reader) (*File, error) {
	f := &File{Namespaces: map[string]*corev1.Namespace{}}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	seen := map[string]bool{}
	for doc := 1; ; doc++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 {
			continue
		}
		var tm typeMeta
		if err := yaml.Unmarshal(raw, &tm); err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if tm.APIVersion != "v1" {
			return nil, fmt.Errorf("document %d: apiVersion %q, want v1", doc, tm.APIVersion)
		}
		switch tm.Kind {
		case "Namespace":
			var ns corev1.Namespace
			if err := yaml.UnmarshalStrict(raw, &ns); err != nil {
				return nil, fmt.Errorf("document %d (Namespace): %w", doc, err)
			}
			if ns.Name == "" {
				return nil, fmt.Errorf("document %d: namespace without a name", doc)
			}
			f.Namespaces[ns.Name] = &ns
		case "Pod":
			var p corev1.Pod
			if err := yaml.UnmarshalStrict(raw, &p); err != nil {
				return nil, fmt.Errorf("document %d (Pod): %w", doc, err)
			}
			if p.Name == "" || p.Namespace == "" {
				return nil, fmt.Errorf("document %d: pod needs metadata.name and metadata.namespace", doc)
			}
			key := p.Namespace + "/" + p.Name
			if seen[key] {
				return nil, fmt.Errorf("document %d: pod %s appears twice", doc, key)
			}
			seen[key] = true
			f.Pods = append(f.Pods, &p)
		default:
			return nil, fmt.Errorf("document %d: kind %q, want Namespace or Pod", doc, tm.Kind)
		}
	}
	return f, nil
}
