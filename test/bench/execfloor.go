// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// execFloorPlugin is an empty static Go program (func main(){}) that the
// runtime helper execs as it execs a CNI plugin: the floor under any
// plugin's start on this machine (exec_floor_ms).
const execFloorPlugin = "exec-floor"

// buildExecFloor builds execFloorPlugin into a temporary directory, as the
// bench's binaries are built (CGO_ENABLED=0, -trimpath, symbols kept:
// testbin.SymbolsEnv), and returns that directory, the floor's CNI bin dir.
func (e *env) buildExecFloor() string {
	e.t.Helper()
	dir := e.t.TempDir()
	src := filepath.Join(dir, "src")
	if err := os.Mkdir(src, 0o755); err != nil {
		e.t.Fatal(err)
	}
	for name, body := range map[string]string{
		"go.mod":  "module execfloor\n\ngo 1.26\n",
		"main.go": "package main\n\nfunc main() {}\n",
	} {
		if err := os.WriteFile(filepath.Join(src, name), []byte(body), 0o644); err != nil {
			e.t.Fatal(err)
		}
	}
	cmd := exec.Command("go", "build", "-trimpath", "-o", filepath.Join(dir, execFloorPlugin), ".")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOWORK=off", "GOFLAGS=")
	if b, err := cmd.CombinedOutput(); err != nil {
		e.t.Fatalf("build the empty program %s: %v: %s", execFloorPlugin, err, b)
	}
	return dir
}

// execFloor times the exec of execFloorPlugin to its exit, once per pod
// (its CNI_* environment), one at a time, exactly as the plugin's start
// alone is timed (CNI VERSION through the runtime helper).
func (e *env) execFloor(binDir string, pods []*simnode.Pod) cniResult {
	e.t.Helper()
	list := fmt.Sprintf(`{"cniVersion": "1.1.0", "name": %q, "plugins": [{"type": %q}]}`, execFloorPlugin, execFloorPlugin)
	req := cniRequest{Command: "VERSION", Conflist: []byte(list), Plugin: execFloorPlugin, BinDir: binDir, Conc: 1, Pods: toCNIPods(pods)}
	var res cniResult
	if err := call(e.runtime, req, &res); err != nil {
		e.t.Fatalf("exec %s: %v", execFloorPlugin, err)
	}
	return res
}
