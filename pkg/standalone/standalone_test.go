// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standalone

import (
	"strings"
	"testing"
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
	}
	for name, in := range cases {
		t.Run(name, func(t *testing.T) {
			if _, err := Parse(strings.NewReader(in)); err == nil {
				t.Error("Parse accepted bad input")
			}
		})
	}
}
