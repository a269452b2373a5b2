// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package features

import (
	"fmt"
	"os"
	"strings"
	"testing"

	ciliumfeatures "github.com/cilium/ebpf/features"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
)

// The documented kernel of every feature is checked against the running
// kernel: a feature missing on a kernel at least that new means the table
// (and docs/KERNELS.md) is wrong or the probe is broken.
// A feature found on an older kernel is a vendor backport, which is fine.
func TestProbesAgreeWithTheDocumentedKernels(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.SkipOrFail(t, "probing BPF features needs root")
	}
	code, err := ciliumfeatures.LinuxVersionCode()
	if err != nil {
		t.Fatalf("kernel version: %v", err)
	}
	running := [3]uint32{code >> 16, (code >> 8) & 0xff, code & 0xff}
	for _, f := range All() {
		t.Run(f.Name, func(t *testing.T) {
			want := atLeast(running, f.Kernel)
			switch got := f.Has(); {
			case !got && want && f.Refusable():
				t.Logf("%s is refused on %d.%d (by policy: the kernel has it from %s)", f.Name, running[0], running[1], f.Kernel)
			case !got && want:
				t.Errorf("%s is documented for Linux %s but missing on %d.%d", f.Name, f.Kernel, running[0], running[1])
			case got && !want:
				t.Logf("%s found on %d.%d, before Linux %s: a backport", f.Name, running[0], running[1], f.Kernel)
			}
		})
	}
	if err := CheckRequired(); err != nil && atLeast(running, MinimumKernel) {
		t.Errorf("Linux %d.%d is at least the documented minimum %s, yet: %v", running[0], running[1], MinimumKernel, err)
	}
}

// atLeast reports whether the running kernel is version ("5.15") or newer.
func atLeast(running [3]uint32, version string) bool {
	v := parse(version)
	return running[0] > v[0] || running[0] == v[0] && running[1] >= v[1]
}

func parse(version string) [3]uint32 {
	var v [3]uint32
	if _, err := fmt.Sscanf(version, "%d.%d", &v[0], &v[1]); err != nil {
		panic(fmt.Sprintf("bad kernel version %q: %v", version, err))
	}
	return v
}

func TestMinimumKernelCoversEveryRequiredFeature(t *testing.T) {
	for _, f := range All() {
		if f.Required && !atLeast(parse(MinimumKernel), f.Kernel) {
			t.Errorf("required feature %s needs Linux %s, newer than the documented minimum %s", f.Name, f.Kernel, MinimumKernel)
		}
	}
}

func TestStringListsEveryFeature(t *testing.T) {
	report := []Status{{Name: "tcx", Kernel: "6.6", Use: "links", Available: true}, {Name: "x", Kernel: "5.7", Use: "y"}}
	out := String(report)
	for _, want := range []string{"tcx", "yes", "Linux 6.6", "x ", "no", "Linux 5.7"} {
		if !strings.Contains(out, want) {
			t.Errorf("String() = %q, missing %q", out, want)
		}
	}
}
