// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/upgrade"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/takeover"
)

// FailpointEnv names a data path step (dataplane.Steps, or
// upgrade.Steps of a start that upgrades the pinned layout, or a
// takeover's takeover.Steps), optionally with
// "#N" for its Nth time, at which the agent kills itself with SIGKILL: no
// cleanup, as a node's OOM killer or a power cut would. It exists for the
// crash-injection tests; an agent without it never stops there.
const FailpointEnv = "AMBIENT_EBPF_FAILPOINT"

// failpointFromEnv returns the dataplane failpoint FailpointEnv asks for,
// nil without it.
func failpointFromEnv() (func(step string), error) {
	spec := os.Getenv(FailpointEnv)
	if spec == "" {
		return nil, nil
	}
	step, nth, hasNth := strings.Cut(spec, "#")
	want := 1
	if hasNth {
		n, err := strconv.Atoi(nth)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s=%q: the count after # is not a positive number", FailpointEnv, spec)
		}
		want = n
	}
	steps := slices.Concat(dataplane.Steps, upgrade.Steps, takeover.Steps)
	if !slices.Contains(steps, step) {
		return nil, fmt.Errorf("%s=%q: no such step (steps: %s)", FailpointEnv, spec, strings.Join(steps, ", "))
	}
	var seen atomic.Int64
	return func(s string) {
		if s == step && seen.Add(1) == int64(want) {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}, nil
}
