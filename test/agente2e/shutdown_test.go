// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agente2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
)

// The log lines of the agent's stop, in the order they must come.
const (
	logReconciling = "reconciling pod"
	logStopping    = "reconciler stopping: no queued pod starts from now on"
	logDecided     = "stopping: uninstall decided"
	logAbandoned   = "stopped; the pods left queued are reconciled at the next start"
	logUninstall   = "uninstalling: removing the CNI plugin and all data path state"
)

// SIGTERM while thousands of running pods wait to be repaired, each
// needing its netns from a /proc of 20000 processes (issue 39: 11 min to
// exit with 5300 queued, SIGKILLed after the grace period with the pins
// left). The agent starts no pod after its reconciler said it stops,
// decides the uninstall before it gives up the queue (still full), and
// carries the uninstall out: nothing stays pinned.
func TestAgentSIGTERMWithALargeQueueUninstallsWithoutDrainingIt(t *testing.T) {
	const pods, procs = 3000, 20000
	n := newAgentNode(t)
	if err := os.WriteFile(n.PodFile, []byte(runningPodFile(pods)), 0o644); err != nil {
		t.Fatal(err)
	}
	n.StartAgent(t, "--uninstall-on-exit", "--log-format=json", "--proc-root", fakeProc(t, procs))
	// The source reported every pod before the first one starts.
	testenv.Eventually(t, time.Minute, "the first pod reconciled", func() bool {
		return strings.Contains(n.Agent.Output.String(), `"msg":"`+logReconciling+`"`)
	})
	// SIGTERM, and SIGKILL should the agent still run a minute later.
	start := time.Now()
	clean := n.Agent.Terminate(time.Minute)
	t.Logf("SIGTERM to exit: %v", time.Since(start))
	lines := agentLog(n.Agent.Output.String())
	stopping, decided, abandoned, uninstall := index(lines, logStopping), index(lines, logDecided), index(lines, logAbandoned), index(lines, logUninstall)
	if stopping < 0 || decided < 0 || abandoned < 0 || uninstall < 0 {
		out := n.Agent.Output.String()
		t.Fatalf("stop lines at %d, %d, %d, %d; want all four (exited cleanly: %v); the agent's output ends:\n%s",
			stopping, decided, abandoned, uninstall, clean, out[max(0, len(out)-4000):])
	}
	if got := countAfter(lines, logStopping, logReconciling); got != 0 {
		t.Errorf("%d pods started after the reconciler said it stops; want none", got)
	}
	if !(decided < abandoned && abandoned < uninstall) {
		t.Errorf("uninstall decided at line %d, queue given up at %d, uninstall at %d; want them in that order", decided, abandoned, uninstall)
	}
	if lines[decided].Uninstall == nil || !*lines[decided].Uninstall {
		t.Errorf("decision %+v; want uninstall", lines[decided])
	}
	if q := lines[abandoned].Queued; q == nil || *q == 0 {
		t.Errorf("queue given up empty; want the backlog still in it")
	} else {
		t.Logf("%d pods started, %d left queued", countAfter(lines, "", logReconciling), *q)
	}
	if !clean {
		t.Errorf("the agent did not exit with status 0 on its own")
	}
	if _, err := os.Stat(n.BPFFSDir); !os.IsNotExist(err) {
		t.Errorf("pins left after the uninstall: %v", err)
	}
}

// logLine is what the test reads of one of the agent's JSON log lines.
type logLine struct {
	Msg       string `json:"msg"`
	Queued    *int   `json:"queued"`
	Uninstall *bool  `json:"uninstall"`
}

// agentLog parses the agent's output, one JSON line per record (other
// lines are passed over).
func agentLog(out string) []logLine {
	var lines []logLine
	for l := range strings.Lines(out) {
		var rec logLine
		if json.Unmarshal([]byte(l), &rec) == nil && rec.Msg != "" {
			lines = append(lines, rec)
		}
	}
	return lines
}

func index(lines []logLine, msg string) int {
	for i, l := range lines {
		if l.Msg == msg {
			return i
		}
	}
	return -1
}

// countAfter counts the lines msg after the first line first (all of
// them for first "").
func countAfter(lines []logLine, first, msg string) int {
	i := index(lines, first)
	if i < 0 && first != "" {
		return 0
	}
	n := 0
	for _, l := range lines[i+1:] {
		if l.Msg == msg {
			n++
		}
	}
	return n
}

// runningPodFile is a pod file of n running pods in the ambient namespace,
// on this node, whose processes /proc does not show (yet): each is to be
// repaired in place, and needs a scan of /proc for its netns.
func runningPodFile(n int) string {
	var b strings.Builder
	b.WriteString("apiVersion: v1\nkind: Namespace\nmetadata: {name: default, labels: {istio.io/dataplane-mode: ambient}}\n")
	for i := range n {
		fmt.Fprintf(&b, "---\napiVersion: v1\nkind: Pod\nmetadata: {name: app-%d, namespace: default, uid: 5e000000-0000-4000-8000-%012d}\n"+
			"spec: {nodeName: %s}\nstatus: {phase: Running, podIP: 198.18.%d.%d}\n", i, i, agentrun.NodeName, 100+i/250, 1+i%250)
	}
	return b.String()
}

// fakeProc is a proc root of n processes of the node, none of a pod.
func fakeProc(t *testing.T, n int) string {
	t.Helper()
	root := t.TempDir()
	for pid := 1; pid <= n; pid++ {
		dir := filepath.Join(root, strconv.Itoa(pid))
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte("0::/system.slice/node-"+strconv.Itoa(pid)+".service\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}
