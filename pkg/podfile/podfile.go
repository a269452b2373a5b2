// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package podfile reads the pod file that stands in for the Kubernetes API
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
// The agent's standalone source (pkg/standalone) and the CNI plugin's
// fallback (FileLookup) both read it. It is a leaf: the plugin links it
// without the agent's reconciler or the BPF loader.
// Names and UIDs are checked as the API server would (pkg/validate): a file
// holding a pod or namespace that Kubernetes would refuse is refused. A pod
// may omit metadata.uid; the agent then gives it validate.StandaloneUID.
package podfile

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
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
// kinds, missing or invalid names and UIDs, and duplicate pods or UIDs are
// refused with the document's position, so a typo never silently drops a pod
// out of the mesh and no name from the file reaches a path unchecked.
func Parse(r io.Reader) (*File, error) {
	f := &File{Namespaces: map[string]*corev1.Namespace{}}
	reader := utilyaml.NewYAMLReader(bufio.NewReader(r))
	seen := map[string]bool{}
	uids := map[types.UID]string{} // namespace/name of each explicit uid
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
			ns, err := parseNamespace(raw)
			if err != nil {
				return nil, fmt.Errorf("document %d (Namespace): %w", doc, err)
			}
			f.Namespaces[ns.Name] = ns
		case "Pod":
			p, err := parsePod(raw)
			if err != nil {
				return nil, fmt.Errorf("document %d (Pod): %w", doc, err)
			}
			key := p.Namespace + "/" + p.Name
			if seen[key] {
				return nil, fmt.Errorf("document %d: pod %s appears twice", doc, key)
			}
			seen[key] = true
			if other, dup := uids[p.UID]; dup {
				return nil, fmt.Errorf("document %d: pod %s has the uid of pod %s", doc, key, other)
			}
			if p.UID != "" {
				uids[p.UID] = key
			}
			f.Pods = append(f.Pods, p)
		default:
			return nil, fmt.Errorf("document %d: kind %q, want Namespace or Pod", doc, tm.Kind)
		}
	}
	return f, nil
}

func parseNamespace(raw []byte) (*corev1.Namespace, error) {
	var ns corev1.Namespace
	if err := yaml.UnmarshalStrict(raw, &ns); err != nil {
		return nil, err
	}
	if ns.Name == "" {
		return nil, errors.New("namespace without a name")
	}
	if err := validate.Namespace(ns.Name); err != nil {
		return nil, err
	}
	return &ns, nil
}

func parsePod(raw []byte) (*corev1.Pod, error) {
	var p corev1.Pod
	if err := yaml.UnmarshalStrict(raw, &p); err != nil {
		return nil, err
	}
	if p.Name == "" || p.Namespace == "" {
		return nil, errors.New("pod needs metadata.name and metadata.namespace")
	}
	if err := validate.PodNames(p.Namespace, p.Name); err != nil {
		return nil, err
	}
	if p.UID != "" {
		if err := validate.PodUID(string(p.UID)); err != nil {
			return nil, fmt.Errorf("pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	return &p, nil
}

// FileLookup reads the pod file at its path on each Lookup: the CNI
// plugin's fallback, which lives for one call. Unlike the agent's source
// it gives a pod without metadata.uid none.
type FileLookup string

// Lookup finds the pod and its namespace in the pod file. A pod missing
// from the file is an error: the plugin never guesses.
func (f FileLookup) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	file, err := Load(string(f))
	if err != nil {
		return nil, nil, err
	}
	pod := file.Pod(namespace, name)
	if pod == nil {
		return nil, nil, fmt.Errorf("pod %s/%s not in pod file %s", namespace, name, string(f))
	}
	// The pod as the file has it: a UID the file does not name is the
	// agent's stand-in, not one a runtime could have been given.
	return pod.DeepCopy(), file.Namespaces[namespace], nil
}
