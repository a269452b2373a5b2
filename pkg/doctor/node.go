// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package doctor

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
)

func checkZtunnel(_ context.Context, n *node) []Finding {
	const check = "ztunnel"
	path := n.cfg.ZDSSocket
	st, err := os.Stat(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return []Finding{{Check: check, Status: Warn, Summary: "no ZDS socket at " + path,
			Meaning: "the agent serves it and ztunnel connects to it; before install this is expected, after it no pod can be handed to ztunnel and new ambient pods fail to start",
			Action:  "start the agent; if ztunnel uses another path, pass it with --zds-socket (and the agent's --zds-socket)"}}
	case err != nil:
		return []Finding{{Check: check, Status: Fail, Summary: err.Error()}}
	case st.Mode()&os.ModeSocket == 0:
		return []Finding{{Check: check, Status: Fail, Summary: path + " is not a socket (" + st.Mode().String() + ")",
			Meaning: "ztunnel cannot connect; the agent removes a stale file at start but refuses anything else", Action: "remove the file and restart the agent"}}
	}
	listening, conns, err := unixSocketState(filepath.Join(n.cfg.ProcRoot, "thread-self", "net", "unix"), path)
	switch {
	case err != nil:
		return []Finding{{Check: check, Status: Warn, Summary: fmt.Sprintf("ZDS socket %s exists; its state cannot be read: %v", path, err)}}
	case !listening:
		return []Finding{{Check: check, Status: Fail, Summary: "nobody listens on " + path,
			Meaning: "a stale socket file: ztunnel's connections are refused", Action: "start the agent (it replaces the file)"}}
	case conns == 0:
		return []Finding{{Check: check, Status: Warn, Summary: "the agent listens on " + path + "; no ztunnel is connected",
			Meaning: "new ambient pods fail to start until ztunnel connects (fail closed); pods enrolled before keep their redirection",
			Action:  "check the ztunnel DaemonSet on this node"}}
	}
	return []Finding{{Check: check, Status: OK, Summary: fmt.Sprintf("the agent listens on %s; %d ztunnel connection(s)", path, conns)}}
}

// unixSocketState reads /proc/net/unix for the sockets bound to path: a
// listener (flag __SO_ACCEPTCON) and the connections it accepted (state
// SS_CONNECTED; accepted sockets carry the listener's path).
// The file is opened on a locked thread: /proc/thread-self/net answers
// for the netns of the thread that opens it (/proc/self/net for the main
// thread's, which a Go program may have left in another netns).
func unixSocketState(procNetUnix, path string) (listening bool, conns int, err error) {
	runtime.LockOSThread()
	f, err := os.Open(procNetUnix)
	runtime.UnlockOSThread()
	if err != nil {
		return false, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Scan() // header: Num RefCount Protocol Flags Type St Inode Path
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || fields[7] != path {
			continue
		}
		flags, _ := strconv.ParseUint(fields[3], 16, 32)
		switch {
		case flags&0x10000 != 0: // __SO_ACCEPTCON
			listening = true
		case fields[5] == "03": // SS_CONNECTED
			conns++
		}
	}
	return listening, conns, sc.Err()
}

// iptablesTools are the iptables-save variants looked for, both backends.
var iptablesTools = []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"}

func checkIstioCNI(ctx context.Context, n *node) []Finding {
	const check = "istio-cni"
	var tools []string
	for _, t := range iptablesTools {
		if _, err := exec.LookPath(t); err == nil {
			tools = append(tools, t)
		}
	}
	if len(tools) == 0 {
		return []Finding{{Check: check, Status: Info, Summary: "no iptables-save found: leftover istio-cni rules were not looked for"}}
	}
	var out []Finding
	node, err := istioChains(ctx, n.cfg.NodeNetns, tools)
	if err != nil {
		out = append(out, Finding{Check: check, Status: Warn, Summary: fmt.Sprintf("node netns: %v", err)})
	}
	if sets, err := istioIPSets(ctx, n.cfg.NodeNetns); err == nil {
		node = append(node, sets...)
	}
	if len(node) > 0 {
		out = append(out, Finding{Check: check, Status: Warn, Summary: "the node still has istio-cni's host rules: " + list(node, 4),
			Meaning: "its POSTROUTING SNAT would translate host probes to pods a second time, by iptables, for the pods still in its ipsets",
			Action:  "remove them (iptables -t nat -D POSTROUTING -j ISTIO_POSTRT; iptables -t nat -F ISTIO_POSTRT; iptables -t nat -X ISTIO_POSTRT; ipset destroy istio-inpod-probes-v4 / -v6), or let istio-cni's uninstall do it"})
	}
	if n.dump != nil {
		for _, m := range n.dump.Meta {
			if m.State != "enrolled" || inspect.CheckNetns(m.Netns, m.NetnsCookie) != nil {
				continue // its netns is gone; tc-hooks says so
			}
			chains, err := istioChains(ctx, m.Netns, tools)
			if err == nil && len(chains) > 0 {
				out = append(out, Finding{Check: check, Status: Warn, Summary: fmt.Sprintf("pod %s still has istio-cni's in-pod rules: %s", m.Pod, list(chains, 4)),
					Meaning: "its traffic meets iptables redirection as well as ours: connections ztunnel should see once may be redirected twice, or not at all",
					Action:  "delete the pod's ISTIO_* chains and their jumps (or restart the pod: its new netns has none)"})
			}
		}
	}
	if len(out) == 0 {
		out = append(out, Finding{Check: check, Status: OK, Summary: "no istio-cni iptables chains or ipsets on the node or in enrolled pods"})
	}
	return out
}

// istioChains lists the ISTIO_* chains iptables-save shows in a netns.
func istioChains(ctx context.Context, netns string, tools []string) ([]string, error) {
	var chains []string
	for _, t := range tools {
		out, err := inNetnsOutput(ctx, netns, t)
		if err != nil {
			return chains, err
		}
		for _, line := range strings.Split(out, "\n") {
			if name, ok := strings.CutPrefix(line, ":ISTIO_"); ok {
				chains = append(chains, t+": ISTIO_"+strings.Fields(name)[0])
			}
		}
	}
	return chains, nil
}

// istioIPSets lists istio-cni's probe ipsets in a netns.
func istioIPSets(ctx context.Context, netns string) ([]string, error) {
	if _, err := exec.LookPath("ipset"); err != nil {
		return nil, err
	}
	out, err := inNetnsOutput(ctx, netns, "ipset", "list", "-n")
	if err != nil {
		return nil, err
	}
	var sets []string
	for _, s := range strings.Fields(out) {
		if strings.HasPrefix(s, "istio-inpod-probes") {
			sets = append(sets, "ipset "+s)
		}
	}
	return sets, nil
}

// inNetnsOutput runs a command in the netns at path ("" for the doctor's
// own) and returns its output.
func inNetnsOutput(ctx context.Context, netns string, name string, args ...string) (string, error) {
	if netns != "" && netns != "/proc/self/ns/net" {
		args = append([]string{"--net=" + netns, name}, args...)
		name = "nsenter"
	}
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}
