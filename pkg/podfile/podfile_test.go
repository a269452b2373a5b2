// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package podfile

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

const sample = `apiVersion: v1
kind: Namespace
metadata:
  name: demo
  labels: {istio.io/dataplane-mode: ambient}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: demo, uid: 11111111-2222-3333-4444-555555555555}
spec: {serviceAccountName: web-sa}
`

func TestParse(t *testing.T) {
	f, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	if f.Namespaces["demo"].Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Errorf("namespace label lost: %+v", f.Namespaces["demo"])
	}
	p := f.Pod("demo", "web")
	if p == nil || p.Spec.ServiceAccountName != "web-sa" || string(p.UID) != "11111111-2222-3333-4444-555555555555" {
		t.Errorf("pod = %+v", p)
	}
}

func TestParseRefusesBadInput(t *testing.T) {
	cases := map[string]string{
		"unknown kind":  "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n",
		"wrong version": "apiVersion: v2\nkind: Pod\nmetadata: {name: x, namespace: y}\n",
		"unknown field": "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: y}\nspec: {nodeNam: n}\n",
		"nameless pod":  "apiVersion: v1\nkind: Pod\nmetadata: {namespace: y}\n",
		"duplicate pod": "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: y}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: y}\n",
		"not yaml":      "{{{",
		"duplicate uid": "apiVersion: v1\nkind: Pod\nmetadata: {name: x, namespace: y, uid: u1}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: z, namespace: y, uid: u1}\n",
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse(strings.NewReader(in)); err == nil {
				t.Error("Parse accepted bad input")
			}
		})
	}
}

// hostileNames are names Kubernetes refuses: traversal, NUL, overlong,
// unicode, separators, upper case.
var hostileNames = []string{
	"..", ".", "../../links", "a/b", "a\x00b", strings.Repeat("a", 254), "ünï", "web\u200b", "web ", "a:b", "WEB", "-web",
}

// The pod whose name once put its pins into links/: every field of a pod
// or namespace that Kubernetes would refuse refuses the file, naming it.
func TestParseRefusesNamesAndUIDsKubernetesWouldRefuse(t *testing.T) {
	type doc struct{ kind, ns, name, uid string }
	var cases []doc
	for _, bad := range hostileNames {
		cases = append(cases,
			doc{"Pod", "shop", bad, ""},
			doc{"Pod", bad, "web", ""},
			doc{"Namespace", "", bad, ""})
		if bad != "WEB" && bad != "-web" { // fine in a uid
			cases = append(cases, doc{"Pod", "shop", "web", bad})
		}
	}
	cases = append(cases, doc{"Pod", "shop", "web", strings.Repeat("u", 40)})
	for _, c := range cases {
		var in string
		if c.kind == "Pod" {
			in = fmt.Sprintf("apiVersion: v1\nkind: Pod\nmetadata: {name: %q, namespace: %q, uid: %q}\n", c.name, c.ns, c.uid)
		} else {
			in = fmt.Sprintf("apiVersion: v1\nkind: Namespace\nmetadata: {name: %q}\n", c.name)
		}
		_, err := Parse(strings.NewReader(in))
		if !errors.Is(err, validate.ErrInvalid) || !strings.Contains(err.Error(), "document 1") {
			t.Errorf("%s %q/%q uid %q: Parse error %v; want an invalid identity in document 1", c.kind, c.ns, c.name, c.uid, err)
		}
	}
}

// Whatever Parse accepts names each pod and namespace with strings that are
// one path element, and no two pods share a namespace/name or a uid.
func FuzzParse(f *testing.F) {
	f.Add([]byte(sample))
	f.Add([]byte("apiVersion: v1\nkind: Pod\nmetadata: {name: ../../links, namespace: shop}\n"))
	f.Add([]byte("apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: shop, uid: ../../links}\n"))
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web","namespace":"shop"}}`))
	f.Add([]byte("apiVersion: v1\nkind: Namespace\nmetadata: {name: \"a\\0b\"}\n---\n---\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := Parse(strings.NewReader(string(data)))
		if err != nil {
			return
		}
		const root = "/sys/fs/bpf/ambient-ebpf/pods"
		oneElement := func(what, s string) {
			if s == "" || strings.ContainsAny(s, "/\x00") || filepath.Dir(filepath.Join(root, s)) != root {
				t.Fatalf("accepted %s %q", what, s)
			}
		}
		for name := range file.Namespaces {
			oneElement("namespace", name)
		}
		keys, uids := map[string]bool{}, map[string]bool{}
		for _, p := range file.Pods {
			oneElement("pod namespace", p.Namespace)
			oneElement("pod name", p.Name)
			uid := string(p.UID)
			if uid == "" {
				uid = validate.StandaloneUID(p.Namespace, p.Name)
			}
			oneElement("pod uid", uid)
			if keys[p.Namespace+"/"+p.Name] || uids[uid] {
				t.Fatalf("pod %s/%s (uid %s) twice", p.Namespace, p.Name, uid)
			}
			keys[p.Namespace+"/"+p.Name], uids[uid] = true, true
			if file.Pod(p.Namespace, p.Name) != p {
				t.Fatalf("Pod(%q, %q) does not find the parsed pod", p.Namespace, p.Name)
			}
		}
	})
}
