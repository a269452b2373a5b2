// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// imageArchs are the architectures the image is built for (the
// Dockerfile's `docker buildx build --platform`), with the ELF machine
// their binaries must be. The BPF objects are bpf2go's -target bpfel, so
// one committed object serves every little-endian architecture.
var imageArchs = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// TestCommandsBuildForEveryImageArch cross-compiles every command of cmd/
// (TestDockerfile holds them to the image's) for each image architecture
// but the host's, which every other test builds, the way the Dockerfile
// and `make build-arm64` do: static (CGO_ENABLED=0) and -trimpath. A
// command that does not build there, or a binary of another machine,
// fails. Warm, this is a few seconds; cold, the architecture's standard
// library and dependencies are compiled once (about 2 min on 2 cores).
func TestCommandsBuildForEveryImageArch(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go not in PATH: %v", err)
	}
	entries, err := os.ReadDir(filepath.Join(repoRoot, "cmd"))
	if err != nil {
		t.Fatal(err)
	}
	for arch, machine := range imageArchs {
		if arch == runtime.GOARCH {
			continue
		}
		t.Run(arch, func(t *testing.T) {
			out := t.TempDir()
			start := time.Now()
			cmd := exec.Command(goBin, "build", "-trimpath", "-o", out+string(filepath.Separator), "./cmd/...")
			cmd.Dir = repoRoot
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
			if b, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("GOARCH=%s go build ./cmd/...: %v\n%s", arch, err, b)
			}
			t.Logf("GOARCH=%s go build ./cmd/... took %s", arch, time.Since(start).Round(time.Millisecond))
			for _, e := range entries {
				if !e.IsDir() {
					continue
				}
				f, err := elf.Open(filepath.Join(out, e.Name()))
				if err != nil {
					t.Errorf("cmd/%s for %s: %v", e.Name(), arch, err)
					continue
				}
				if f.Machine != machine {
					t.Errorf("cmd/%s for %s is a %s binary, want %s", e.Name(), arch, f.Machine, machine)
				}
				if f.Section(".interp") != nil {
					t.Errorf("cmd/%s for %s is dynamically linked, want static", e.Name(), arch)
				}
				f.Close()
			}
		})
	}
}
