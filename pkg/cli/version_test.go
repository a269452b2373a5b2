// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cli

import (
	"encoding/json"
	"runtime"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
)

// version and --version print the binary's build information.
func TestVersion(t *testing.T) {
	want := buildinfo.Read()
	if out := run(t, "--version"); out != "ambient-ebpf "+want.String()+"\n" {
		t.Errorf("--version printed %q, want ambient-ebpf %s", out, want)
	}
	if out := run(t, "version"); !strings.Contains(out, want.Version) || !strings.Contains(out, want.GoVersion) || !strings.Contains(out, runtime.GOOS+"/"+runtime.GOARCH) {
		t.Errorf("version printed %q, want %s, %s and the platform in it", out, want.Version, want.GoVersion)
	}
	var got buildinfo.Info
	if err := json.Unmarshal([]byte(run(t, "-o", "json", "version")), &got); err != nil || got != want {
		t.Errorf("version -o json = %+v, %v; want %+v", got, err, want)
	}
}
