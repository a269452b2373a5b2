// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
)

// The agent lifts its soft open file limit to the hard one and weighs it
// against the data path's pod capacity: below what loading the data path
// needs it refuses to start, naming the limit and the need, before it
// touches the node; below what every pod starting at once needs it warns,
// saying what to raise, and runs.
func TestAgentWeighsItsOpenFileLimit(t *testing.T) {
	n := newAgentNode(t, "a")
	n.Wrapper = []string{"prlimit", "--nofile=256:512", "--"}
	n.StartAgent(t)
	if !testenv.Poll(time.Minute, n.Agent.Exited) {
		t.Fatalf("agent with a hard limit of 512 still runs:\n%s", n.Agent.Output.String())
	}
	out := n.Agent.Output.String()
	for _, want := range []string{"open file limit too low", "RLIMIT_NOFILE is 512 (hard 512)", fmt.Sprintf("at least %d", fdlimit.Base), "LimitNOFILE"} {
		if !strings.Contains(out, want) {
			t.Errorf("refusal does not say %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(n.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused agent left pins: %v", err)
	}

	short := fdlimit.Need(bpfobj.MaxPods) / 2
	n.Wrapper = []string{"prlimit", fmt.Sprintf("--nofile=%d:%d", fdlimit.Base, short), "--"}
	n.StartReadyAgent(t, "--uninstall-on-exit")
	out = n.Agent.Output.String()
	for _, want := range []string{fmt.Sprintf("RLIMIT_NOFILE is %d (hard %d)", short, short), fmt.Sprintf("below the %d descriptors", fdlimit.Need(bpfobj.MaxPods)), "LimitNOFILE"} {
		if !strings.Contains(out, want) {
			t.Errorf("warning does not say %q:\n%s", want, out)
		}
	}
	if err := n.Stop(10 * time.Second); err != nil {
		t.Error(err)
	}
}
