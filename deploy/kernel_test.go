// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"sigs.k8s.io/yaml"
)

// minKernel is the repository README's "Minimum kernel: **Linux X.Y**".
func minKernel(t *testing.T) (major, minor int) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`Minimum kernel: \*\*Linux (\d+)\.(\d+)\*\*`).FindSubmatch(b)
	if m == nil {
		t.Fatal("README.md states no minimum kernel")
	}
	major, _ = strconv.Atoi(string(m[1]))
	minor, _ = strconv.Atoi(string(m[2]))
	return major, minor
}

// TestOneKernelRequirement: what the chart says the nodes need is the
// repository README's minimum kernel, and the chart README's Node Feature
// Discovery affinity admits exactly the kernels from it on.
func TestOneKernelRequirement(t *testing.T) {
	major, minor := minKernel(t)
	want := fmt.Sprintf("%d.%d", major, minor)
	need := regexp.MustCompile(`(?i)(?:need[s]?|requires?|with)\s+Linux\s*(?:>=\s*)?(\d+\.\d+)|Linux\s+(\d+\.\d+)\s+or\s+(?:later|newer)`)
	for _, f := range []string{"Chart.yaml", "README.md", "values.yaml"} {
		b, err := os.ReadFile(filepath.Join(chartDir, f))
		if err != nil {
			t.Fatal(err)
		}
		text := strings.Join(strings.Fields(string(b)), " ") // phrases wrap
		found := false
		for _, m := range need.FindAllStringSubmatch(text, -1) {
			got := m[1] + m[2]
			found = true
			if got != want {
				t.Errorf("%s: %q, the README's minimum is Linux %s", f, m[0], want)
			}
		}
		if !found {
			t.Errorf("%s does not say which kernel the nodes need (Linux %s)", f, want)
		}
	}

	aff := readmeAffinity(t)
	for _, k := range []struct {
		major, minor int
	}{{major - 1, 99}, {major, minor - 1}, {major, minor}, {major, minor + 1}, {major + 1, 0}, {major + 2, 6}} {
		node := labels.Set{
			"feature.node.kubernetes.io/kernel-version.major": strconv.Itoa(k.major),
			"feature.node.kubernetes.io/kernel-version.minor": strconv.Itoa(k.minor),
		}
		wantOK := k.major > major || (k.major == major && k.minor >= minor)
		if got := admits(t, aff, node); got != wantOK {
			t.Errorf("README affinity on Linux %d.%d: admitted %v, want %v", k.major, k.minor, got, wantOK)
		}
	}
}

// readmeAffinity is the first ```yaml block of the chart README that holds
// an affinity.
func readmeAffinity(t *testing.T) *corev1.Affinity {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(chartDir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile("(?s)```yaml\n(.*?)```").FindAllSubmatch(b, -1) {
		var v struct {
			Affinity *corev1.Affinity `json:"affinity"`
		}
		if err := yaml.UnmarshalStrict(dedent(string(m[1])), &v); err == nil && v.Affinity != nil {
			return v.Affinity
		}
	}
	t.Fatal("chart README has no affinity example")
	return nil
}

// dedent removes the indentation of the block's first line from each line.
func dedent(s string) []byte {
	first := s[:len(s)-len(strings.TrimLeft(s, " "))]
	var out strings.Builder
	for l := range strings.Lines(s) {
		out.WriteString(strings.TrimPrefix(l, first))
	}
	return []byte(out.String())
}

// admits evaluates the required node affinity on a node's labels as the
// scheduler does: any term, all of its expressions.
func admits(t *testing.T, aff *corev1.Affinity, node labels.Set) bool {
	t.Helper()
	ops := map[corev1.NodeSelectorOperator]selection.Operator{
		corev1.NodeSelectorOpIn: selection.In, corev1.NodeSelectorOpNotIn: selection.NotIn,
		corev1.NodeSelectorOpGt: selection.GreaterThan, corev1.NodeSelectorOpLt: selection.LessThan,
		corev1.NodeSelectorOpExists: selection.Exists, corev1.NodeSelectorOpDoesNotExist: selection.DoesNotExist,
	}
	for _, term := range aff.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		sel := labels.NewSelector()
		for _, e := range term.MatchExpressions {
			r, err := labels.NewRequirement(e.Key, ops[e.Operator], e.Values)
			if err != nil {
				t.Fatalf("expression %+v: %v", e, err)
			}
			sel = sel.Add(*r)
		}
		if sel.Matches(node) {
			return true
		}
	}
	return false
}
