// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package doctor

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

func checkKernel(context.Context, *node) []Finding {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return []Finding{{Check: "kernel", Status: Warn, Summary: fmt.Sprintf("uname: %v", err)}}
	}
	return []Finding{kernelFinding(unix.ByteSliceToString(u.Release[:]), unix.ByteSliceToString(u.Machine[:]), runtime.GOARCH)}
}

// kernelFinding grades the kernel release and machine (uname -r, -m)
// against the architecture the binary was built for (arch, GOARCH).
func kernelFinding(release, machine, arch string) Finding {
	f := Finding{Check: "kernel", Status: OK, Summary: fmt.Sprintf("Linux %s (%s), this binary %s/%s; ambient-ebpf is tested from Linux %s on",
		release, machine, runtime.GOOS, arch, features.MinimumKernel),
		Meaning: "the agent probes each feature below rather than trusting the version: vendor kernels backport"}
	if want := goArch(machine); want != "" && want != arch {
		f.Status = Warn
		f.Meaning = fmt.Sprintf("this binary is built for %s on a %s kernel: it runs emulated, or not at all", arch, machine)
		f.Action = fmt.Sprintf("run ambient-ebpf built for %s", want)
	}
	return f
}

// goArch is Go's name of a kernel's machine (uname -m), "" when unknown.
func goArch(machine string) string {
	switch machine {
	case "x86_64":
		return "amd64"
	case "aarch64":
		return "arm64"
	}
	return ""
}

func checkFeatures(context.Context, *node) []Finding {
	var out []Finding
	for _, s := range features.Report() {
		f := Finding{Check: "feature/" + s.Name, Status: OK, Summary: fmt.Sprintf("available (Linux %s): %s", s.Kernel, s.Use)}
		switch {
		case !s.Available && s.Required:
			f.Status, f.Summary = Fail, fmt.Sprintf("missing (Linux %s): %s", s.Kernel, s.Use)
			f.Meaning = s.Without
			f.Action = fmt.Sprintf("run a kernel with this feature (upstream Linux %s or newer, or a vendor kernel that backports it)", s.Kernel)
		case !s.Available:
			f.Status, f.Summary = Info, fmt.Sprintf("missing (Linux %s); the fallback is used", s.Kernel)
			f.Meaning = "without it " + s.Without
		}
		out = append(out, f)
	}
	return out
}

func checkCgroup2(_ context.Context, n *node) []Finding {
	mounts, err := hostfs.Mounts()
	if err != nil {
		return []Finding{{Check: "cgroup2", Status: Fail, Summary: err.Error()}}
	}
	var v2 []string
	v1 := 0
	for _, m := range mounts {
		switch m.FSType {
		case "cgroup2":
			v2 = append(v2, m.MountPoint)
		case "cgroup":
			v1++
		}
	}
	if len(v2) == 0 {
		return []Finding{{Check: "cgroup2", Status: Fail, Summary: "no cgroup v2 hierarchy is mounted",
			Meaning: "the socket hooks (outbound capture R1, DNS R9) attach to a cgroup v2 directory; without one the agent cannot start",
			Action:  "boot with cgroup v2 (systemd.unified_cgroup_hierarchy=1) or mount it: mount -t cgroup2 none /sys/fs/cgroup"}}
	}
	root := n.cfg.CgroupRoot
	if root == "" {
		root = v2[0]
	}
	if _, err := hostfs.CgroupID(root); err != nil {
		return []Finding{{Check: "cgroup2", Status: Fail, Summary: fmt.Sprintf("cgroup root %s: %v", root, err),
			Meaning: "the agent attaches its socket hooks there and refuses to start", Action: "point --cgroup-root at a cgroup v2 directory above every pod and ztunnel"}}
	}
	n.cgroup2 = root
	f := Finding{Check: "cgroup2", Status: OK, Summary: fmt.Sprintf("cgroup v2 mounted at %s; the socket hooks attach to %s", list(v2, 3), root)}
	if v1 > 0 {
		f.Summary += fmt.Sprintf(" (hybrid layout: %d cgroup v1 hierarchies mounted too)", v1)
		f.Meaning = "every process is in the v2 tree as well, so the hooks on its root see every pod"
	}
	return []Finding{f}
}

func checkBPFFS(_ context.Context, n *node) []Finding {
	mnt := filepath.Dir(n.cfg.BPFFSDir)
	ok, err := hostfs.IsBPFFS(mnt)
	switch {
	case err != nil:
		return []Finding{{Check: "bpffs", Status: Fail, Summary: err.Error(),
			Meaning: "the data path pins its maps and links under " + n.cfg.BPFFSDir + "; the agent refuses to start without a bpffs there",
			Action:  "mount -t bpf bpf " + mnt + " (and mount it into the agent's pod: the Helm chart mounts the host's /sys/fs/bpf)"}}
	case !ok:
		return []Finding{{Check: "bpffs", Status: Fail, Summary: mnt + " is not a bpffs",
			Meaning: "the agent mounts a bpffs there at start only where the mount reaches the host (a privileged pod's Bidirectional volume) and refuses to start otherwise: pins in its own mount namespace would go with its container",
			Action:  "mount -t bpf bpf " + mnt + " (or run the agent privileged: securityContext.privileged=true)"}}
	}
	return []Finding{{Check: "bpffs", Status: OK, Summary: "bpffs mounted at " + mnt}}
}

func checkDataPath(_ context.Context, n *node) []Finding {
	if n.pinned == nil {
		if errors.Is(n.pinErr, inspect.ErrNotInstalled) {
			return []Finding{{Check: "datapath", Status: Info, Summary: "no data path pinned at " + n.cfg.BPFFSDir,
				Meaning: "before install this is expected; after install the agent has not started yet, or was uninstalled"}}
		}
		return []Finding{{Check: "datapath", Status: Fail, Summary: fmt.Sprintf("pins at %s cannot be read: %v", n.cfg.BPFFSDir, n.pinErr),
			Action: "check that this CLI matches the agent's version (the map layouts must agree)"}}
	}
	enrolled := 0
	var partial []string
	for _, m := range n.dump.Meta {
		if m.State == "enrolled" {
			enrolled++
		} else {
			partial = append(partial, m.Pod+" ("+m.State+")")
		}
	}
	out := []Finding{{Check: "datapath", Status: OK, Summary: fmt.Sprintf("data path pinned at %s: %d pods enrolled", n.cfg.BPFFSDir, enrolled)}}
	switch on, held, err := inspect.TraceState(n.cfg.BPFFSDir); {
	case err != nil:
		out = append(out, Finding{Check: "trace", Status: Info, Summary: fmt.Sprintf("the trace flag cannot be read: %v", err),
			Meaning: "pins of an agent from before tracing; the next agent start adds it"})
	case on && !held:
		out = append(out, Finding{Check: "trace", Status: Warn, Summary: "the programs write trace events, but nobody reads them",
			Meaning: "a tracer died: until tracing is switched off, every decision pays for an event that fills the ring buffer",
			Action:  "run `ambient-ebpf trace --pins --count 1` and interrupt it (it switches the events off), or restart the agent"})
	case on:
		out = append(out, Finding{Check: "trace", Status: Info, Summary: "someone is tracing: the programs write an event for each decision"})
	}
	out = append(out, checkAccel(n)...)
	if pods, err := n.pinned.Pods(); err == nil {
		var lost []string
		for _, p := range pods {
			if p.Problem != "" {
				lost = append(lost, p.Namespace+"/"+p.Name+" ("+p.Problem+")")
			}
		}
		if len(lost) > 0 {
			out = append(out, Finding{Check: "datapath", Status: Fail, Summary: "pods recorded as enrolled are not fully redirected: " + list(lost, 5),
				Meaning: "their traffic to the addresses named reaches the app past ztunnel and its policies (a duplicate pod IP, under an agent from before the refusal of duplicates)",
				Action:  "restart the agent: it restores the entries unless another running pod has the address (its log names both pods); then remove the pod that should not have it"})
		}
	}
	out = append(out, checkListeners(n)...)
	if len(partial) > 0 {
		out = append(out, Finding{Check: "datapath", Status: Warn, Summary: "an agent stopped part way through " + list(partial, 5),
			Meaning: "the journal keeps such pods from staying half redirected: the next agent to start undoes it and they are enrolled again",
			Action:  "make sure the agent is running (ambient-ebpf status)"})
	}
	return out
}

// checkListeners reports ae_listeners, ztunnel's inbound listeners by pod
// (R5, the sk_lookup mode): pods with none filed refuse inbound
// connections.
func checkListeners(n *node) []Finding {
	const check = "listeners"
	st, err := n.pinned.Listeners()
	if err != nil {
		return []Finding{{Check: check, Status: Warn, Summary: err.Error()}}
	}
	if st.Capacity == 0 {
		return nil // inbound goes through tc on this kernel
	}
	var out []Finding
	if len(st.Missing) > 0 {
		out = append(out, Finding{Check: check, Status: Warn, Summary: fmt.Sprintf("%d enrolled pods have no ztunnel inbound listener filed: %s", len(st.Missing), list(st.Missing, 5)),
			Meaning: "their inbound connections are refused (fail closed) until one is: ztunnel has not been handed them yet, is down, or ae_listeners had no room when it listened; the agent files them within 30 s of ztunnel listening",
			Action:  "check ztunnel on this node and that the agent runs (ambient-ebpf status)"})
	}
	if st.NotEnrolled > 0 {
		out = append(out, Finding{Check: check, Status: Warn, Summary: fmt.Sprintf("%d of the %d ae_listeners entries are of netns that are not enrolled", st.NotEnrolled, st.Entries),
			Meaning: "removed pods' listeners, or ones an earlier agent filed for any netns (a local user with a user namespace can fill the table that way); the agent prunes them every 30 s",
			Action:  "make sure the agent is running (ambient-ebpf status)"})
	}
	if d, err := n.pinned.Decisions(); err == nil && d.ByReason[inspect.ReasonListenerFull] > 0 {
		out = append(out, Finding{Check: check, Status: Warn, Summary: fmt.Sprintf("ztunnel's listeners found ae_listeners full %d times since the maps were made", d.ByReason[inspect.ReasonListenerFull]),
			Meaning: "those listeners were not filed when they started; the agent's resync files them once there is room"})
	}
	if len(out) == 0 {
		out = append(out, Finding{Check: check, Status: OK, Summary: fmt.Sprintf("every enrolled pod has ztunnel's inbound listener filed (ae_listeners: %d of %d)", st.Entries, st.Capacity)})
	}
	return out
}

// checkAccel reports the sockmap acceleration (--sockmap-accel) when its
// pins exist.
func checkAccel(n *node) []Finding {
	info, err := accel.Read(n.cfg.BPFFSDir)
	switch {
	case err != nil:
		return []Finding{{Check: "sockmap", Status: Warn, Summary: fmt.Sprintf("the sockmap acceleration's pins cannot be read: %v", err)}}
	case !info.Installed:
		return nil
	case !info.Active:
		return []Finding{{Check: "sockmap", Status: Info, Summary: fmt.Sprintf("sockmap acceleration off; %d sockets accelerated before keep it until they close", info.Senders+info.Receivers),
			Meaning: "the next agent start with --sockmap-accel=off after they closed removes its maps"}}
	}
	s := info.Stats
	f := Finding{Check: "sockmap", Status: Info, Summary: fmt.Sprintf("sockmap acceleration on: %d senders and %d receivers in the sockmaps; %d MiB redirected in %d sends, %d sends over TCP, %d sockets refused",
		info.Senders, info.Receivers, s.RedirectBytes>>20, s.RedirectMsgs, s.PassMsgs, s.InsertErrors),
		Meaning: "the app <-> ztunnel hop skips TCP; the kernel does not hold back a sender whose receiver does not read, and with --sockmap-accel=both apps that read with splice(2) miss bytes (docs/BENCHMARKS.md)"}
	return []Finding{f}
}

// rewriting are the hooks where another program changes what ours sees
// or answers.
var rewriting = []string{"connect4", "connect6", "sendmsg4", "sendmsg6", "getsockopt"}

func checkCgroupHooks(_ context.Context, n *node) []Finding {
	if n.cgroup2 == "" {
		return nil
	}
	progs, truncated, err := inspect.CgroupPrograms(n.cgroup2, n.cfg.BPFFSDir, n.cfg.MaxCgroups)
	if err != nil {
		return []Finding{{Check: "cgroup-hooks", Status: Warn, Summary: fmt.Sprintf("cannot list the programs on the cgroup hooks: %v", err)}}
	}
	var out []Finding
	if n.pinned != nil {
		var missing []string
		// At the root, or at the pods' cgroup below it (--pods-cgroup),
		// with the node-wide half at the root.
		for _, hook := range inspect.SocketHooks() {
			if !slices.ContainsFunc(progs, func(p inspect.CgroupProgram) bool { return p.Ours && p.Hook == hook }) {
				missing = append(missing, hook)
			}
		}
		if len(missing) > 0 {
			out = append(out, Finding{Check: "cgroup-hooks", Status: Fail, Summary: fmt.Sprintf("our programs are not attached below %s on %s", n.cgroup2, strings.Join(missing, ", ")),
				Meaning: "outbound capture (R1), DNS (R9) and SO_ORIGINAL_DST need every one of them; the pins belong to another cgroup root or were detached",
				Action:  "start the agent with the cgroup root it was installed with, or uninstall and install again"})
		} else {
			where := n.cgroup2
			if pods := podsCgroupOf(progs, n.cgroup2); pods != "" {
				where = pods
				if slices.ContainsFunc(progs, func(p inspect.CgroupProgram) bool { return p.Ours && p.Cgroup == n.cgroup2 }) {
					where += ", their node-wide half (connect4, connect6, sockops) to " + n.cgroup2
				} else {
					where += ", nothing to " + n.cgroup2 + " (host probes are filed at tcp_connect)"
				}
			}
			out = append(out, Finding{Check: "cgroup-hooks", Status: OK, Summary: fmt.Sprintf("our %d socket hooks are attached to %s", len(inspect.SocketHooks()), where)})
		}
	}
	// A program holding a hook alone keeps ours off it: the agent cannot
	// start (before install) or a restarted one cannot attach again.
	mount, _ := hostfs.Cgroup2Root()
	if holders, err := inspect.ExclusiveHolders(mount, n.cgroup2); err == nil {
		for _, h := range holders {
			out = append(out, Finding{Check: "cgroup-hooks", Status: Fail, Summary: h.String(),
				Meaning: "the kernel refuses every other program on that hook (EPERM): the agent cannot attach its socket programs and refuses to start",
				Action:  fmt.Sprintf("have its owner attach with BPF_F_ALLOW_MULTI or a bpf_link (Cilium's socket load balancer does from 1.14), or detach it: bpftool cgroup detach %s %s id %d", h.Cgroup, bpftoolHook(h.Hook), h.ID)})
		}
	}
	// One finding per foreign program and cgroup, naming its hooks.
	type owner struct {
		cgroup, name string
		id           uint32
	}
	hooks := map[owner][]string{}
	var order []owner
	for _, p := range progs {
		if p.Ours {
			continue
		}
		o := owner{p.Cgroup, p.Name, p.ID}
		if hooks[o] == nil {
			order = append(order, o)
		}
		hooks[o] = append(hooks[o], p.Hook)
	}
	// Ours on a pods' cgroup below the root (--pods-cgroup): the pods'
	// sockets meet them before anything at the root.
	podsCgroup := podsCgroupOf(progs, n.cgroup2)
	for _, o := range order {
		f := Finding{Check: "cgroup-hooks", Status: Info, Summary: fmt.Sprintf("program %s (id %d) on %s of %s", o.name, o.id, strings.Join(hooks[o], ", "), o.cgroup)}
		where := "runs beside ours for every socket below the root"
		switch {
		case podsCgroup != "" && !strings.HasPrefix(o.cgroup+"/", podsCgroup+"/"):
			f.Meaning = "runs after ours for the pods' sockets (ours are attached to " + podsCgroup + "): it sees an enrolled pod's connection already sent to ztunnel, and load-balances the rest"
			out = append(out, f)
			continue
		case o.cgroup != n.cgroup2:
			where = "runs before ours for the sockets of that cgroup"
		}
		if slices.ContainsFunc(hooks[o], func(h string) bool { return slices.Contains(rewriting, h) }) {
			f.Status = Warn
			f.Meaning = where + ": if it rewrites destinations (a socket load balancer), ztunnel is handed the address it chose, not the one the app asked for; on getsockopt it may answer SO_ORIGINAL_DST itself"
			f.Action = "make it leave enrolled pods' sockets alone"
			if strings.HasPrefix(o.name, "cil_sock") {
				f.Action = "this is Cilium's socket load balancer: set socketLB.hostNamespaceOnly=true, as Istio ambient mode requires"
			} else if strings.HasPrefix(o.name, "ae_") {
				f.Action = "this looks like another ambient-ebpf install (another --bpffs-dir): uninstall one of them"
			}
		} else {
			f.Meaning = where + "; it cannot change where ours sends a connection"
		}
		out = append(out, f)
	}
	if len(order) == 0 {
		out = append(out, Finding{Check: "cgroup-hooks", Status: OK, Summary: fmt.Sprintf("no other program on the socket hooks in the cgroup tree at %s", n.cgroup2)})
	}
	if truncated {
		out = append(out, Finding{Check: "cgroup-hooks", Status: Info, Summary: fmt.Sprintf("only the first %d cgroups below %s were checked", n.cfg.MaxCgroups, n.cgroup2)})
	}
	return out
}

// podsCgroupOf is the pods' cgroup our socket programs are attached to
// below root (--pods-cgroup: where our getsockopt is, which the node-wide
// half lacks), or "" when they are on root.
func podsCgroupOf(progs []inspect.CgroupProgram, root string) string {
	i := slices.IndexFunc(progs, func(p inspect.CgroupProgram) bool { return p.Ours && p.Hook == "getsockopt" })
	if i < 0 || progs[i].Cgroup == root {
		return ""
	}
	return progs[i].Cgroup
}

// bpftoolHook is bpftool's name of one of our socket hooks.
func bpftoolHook(hook string) string {
	if hook == "sockops" {
		return "sock_ops"
	}
	return hook
}

// hookRows names what each per-pod hook does (pin name prefix).
var hookRows = []struct{ pin, does string }{
	{"host_egress", "host probes are translated to the probe address (H1)"},
	{"host_ingress", "replies to translated probes find the prober (H1)"},
	{"lo_ingress", "the app's replies to ztunnel's deliveries come back to ztunnel (R10)"},
	{"reroute_", "TCP from the virtual interface goes to ztunnel (R14)"},
	{"ingress", "inbound flows are filed for sk_lookup (R5)"},
	{"sk_lookup", "inbound flows reach ztunnel's :15006 (R5)"},
}

func hookDoes(pin string) string {
	for _, r := range hookRows {
		if strings.HasPrefix(pin, r.pin) {
			return r.does
		}
	}
	return pin
}

func checkTCHooks(_ context.Context, n *node) []Finding {
	if n.pinned == nil {
		return nil
	}
	hooks, err := n.pinned.TCHooks(n.cfg.NodeNetns)
	if err != nil {
		return []Finding{{Check: "tc-hooks", Status: Warn, Summary: fmt.Sprintf("cannot read the pods' hooks: %v", err)}}
	}
	var out []Finding
	// Programs ahead of ours, grouped: a primary CNI puts the same ones
	// on every pod.
	type group struct {
		pin, ahead string
		pods       []string
	}
	var groups []*group
	checked := 0
	for _, h := range hooks {
		where := fmt.Sprintf("%s on %s", h.Direction, h.Interface)
		if h.Interface == "" {
			where = "sk_lookup in " + h.Netns
		}
		switch {
		case h.Error != "":
			out = append(out, Finding{Check: "tc-hooks", Status: Warn, Summary: fmt.Sprintf("pod %s: %s (%s) cannot be read: %s", h.Pod, h.Pin, where, h.Error),
				Meaning: "a pod whose netns or interface is gone still has its pins; the agent's reconcile removes or re-enrolls it"})
			continue
		case !h.Attached:
			out = append(out, Finding{Check: "tc-hooks", Status: Fail, Summary: fmt.Sprintf("pod %s: our program is missing from %s (%s)", h.Pod, where, h.Pin),
				Meaning: "it is the program by which " + hookDoes(h.Pin) + "; for this pod that no longer happens",
				Action:  "restart the agent (adoption puts it back), and find what deleted it (a CNI that replaces the clsact qdisc?)"})
			continue
		}
		checked++
		if len(h.Ahead) == 0 {
			continue
		}
		var names []string
		for _, e := range h.Ahead {
			name := e.Kind
			if e.Name != "" {
				name += " " + e.Name
			}
			if e.Priority != 0 {
				name += fmt.Sprintf(" (priority %d)", e.Priority)
			}
			names = append(names, name)
		}
		key := h.Pin + "|" + strings.Join(names, ", ")
		i := slices.IndexFunc(groups, func(g *group) bool { return g.pin+"|"+g.ahead == key })
		if i < 0 {
			groups = append(groups, &group{pin: h.Pin, ahead: strings.Join(names, ", ")})
			i = len(groups) - 1
		}
		groups[i].pods = append(groups[i].pods, h.Pod)
	}
	for _, g := range groups {
		f := Finding{Check: "tc-hooks", Status: Warn,
			Summary: fmt.Sprintf("%s runs before ours at %s of %d pods (%s)", g.ahead, g.pin, len(g.pods), list(g.pods, 3)),
			Meaning: "ours runs only if each of these passes the packet on (TCX_NEXT, TC_ACT_UNSPEC); one that returns TC_ACT_OK or redirects ends the chain, and then no longer " + hookDoes(g.pin),
			Action:  "check that the primary CNI chains (Cilium, Calico and other TCX users pass packets on by default)"}
		if g.pin == "host_egress" || g.pin == "host_ingress" {
			// A BPF CNI that forwards the pods' packets itself (Cilium's
			// host routing) drops the replies to the probe address.
			f.Action += "; or run host probes in the direct mode (--host-probes=direct, chart agent.hostProbes: direct), which puts nothing on the node side of the pods' veths"
		}
		out = append(out, f)
	}
	if checked > 0 && len(groups) == 0 {
		out = append(out, Finding{Check: "tc-hooks", Status: OK, Summary: fmt.Sprintf("all %d per-pod hooks have our program, nothing ahead of it", checked)})
	}
	return out
}

// checkHostProbes names the host-probe mode the pinned programs run in,
// and in the SNAT mode what on this node drops replies to the probe
// address: a program ahead of ours on the node side of a pod's veth (a BPF
// CNI forwarding by the FIB, where 169.254.7.127 has no route).
func checkHostProbes(_ context.Context, n *node) []Finding {
	const check = "host-probes"
	if n.pinned == nil {
		return nil
	}
	if n.pinned.ProbeMode() == bpfobj.ProbeDirect {
		return []Finding{{Check: check, Status: OK, Summary: "direct: the node's connections to enrolled pods (kubelet's probes) reach the app with the node's own address",
			Meaning: "no address is rewritten and nothing runs on the node side of the pods' veths; a NetworkPolicy sees the node, as without the mesh"}}
	}
	f := Finding{Check: check, Status: OK, Summary: "snat: kubelet's probes reach enrolled pods from the link-local SNAT address (--probe-snat-v4/v6), as with istio-cni",
		Meaning: "replies to the link-local address must come back through the node side of each pod's veth; NetworkPolicies must allow it"}
	hooks, err := n.pinned.TCHooks(n.cfg.NodeNetns)
	if err != nil {
		return []Finding{f}
	}
	var pods []string
	for _, h := range hooks {
		if h.Pin == "host_ingress" && len(h.Ahead) > 0 && !slices.Contains(pods, h.Pod) {
			pods = append(pods, h.Pod)
		}
	}
	if len(pods) > 0 {
		f.Status = Warn
		f.Summary += fmt.Sprintf("; another program takes the pods' replies first on %d pods (%s)", len(pods), list(pods, 3))
		f.Meaning = "a BPF CNI that forwards pods' packets itself (Cilium's BPF host routing or masquerade) drops replies to the link-local probe address, and kubelet's probes fail (istio/istio#52208)"
		f.Action = "run host probes in the direct mode: --host-probes=direct (chart agent.hostProbes: direct); the agent's restart moves every pod, none restarts"
	}
	return []Finding{f}
}

func checkCNI(_ context.Context, n *node) []Finding {
	const check = "cni"
	files, err := install.ReadConfDir(n.cfg.CNIConfDir)
	if err == nil && len(files) == 0 {
		err = errors.New("no .conf, .conflist or .json file")
	}
	if err != nil {
		return []Finding{{Check: check, Status: Warn, Summary: fmt.Sprintf("CNI configuration in %s: %v", n.cfg.CNIConfDir, err),
			Meaning: "the primary CNI has not written its configuration yet; the installer chains into it once it does, and until then pods cannot start",
			Action:  "install the primary CNI; if the runtime reads another directory, pass it with --cni-conf-dir"}}
	}
	var out []Finding
	first := files[0]
	if first.Err != "" {
		out = append(out, Finding{Check: check, Status: Fail, Summary: fmt.Sprintf("%s does not parse: %s", first.Path, first.Err),
			Meaning: "it is the first file by name: containerd refuses to load the directory (no pod gets a network); CRI-O and the installer skip it",
			Action:  "fix or remove the file"})
	}
	i := slices.IndexFunc(files, func(f install.ConfFile) bool { return f.Err == "" })
	if i < 0 {
		return out
	}
	used := files[i]
	chain := strings.Join(used.Plugins, " -> ")
	ours := slices.Index(used.Plugins, install.PluginType)
	switch {
	case ours < 0:
		out = append(out, Finding{Check: check, Status: Info, Summary: fmt.Sprintf("the runtime uses %s (network %q): %s; %s is not in it", used.Path, used.Name, chain, install.PluginType),
			Meaning: "before install this is expected; after install new pods start without being enrolled at ADD (the agent repairs them later, but they start unredirected)",
			Action:  "check the agent's installer (istio_cni_install_ready, its log) and --cni-conf-dir"})
	case ours == 0:
		out = append(out, Finding{Check: check, Status: Fail, Summary: fmt.Sprintf("%s is first in %s: %s", install.PluginType, used.Path, chain),
			Meaning: "it needs the primary plugin's result (the pod's addresses): every ADD fails",
			Action:  "let the installer rewrite the file (remove our entry; it chains after the primary)"})
	default:
		out = append(out, Finding{Check: check, Status: OK, Summary: fmt.Sprintf("the runtime uses %s (network %q, CNI %s): %s", used.Path, used.Name, used.CNIVersion, chain)})
	}
	if slices.Contains(used.Plugins, "istio-cni") {
		out = append(out, Finding{Check: check, Status: Warn, Summary: "istio-cni is chained in " + used.Path + " too",
			Meaning: "two node agents would redirect the same pods, istio-cni with iptables rules inside them",
			Action:  "uninstall istio-cni's node agent (its DaemonSet removes its entry) before or after installing ambient-ebpf, not beside it"})
	}
	for _, f := range files[i+1:] {
		if slices.Contains(f.Plugins, install.PluginType) {
			out = append(out, Finding{Check: check, Status: Info, Summary: fmt.Sprintf("%s also names %s, but the runtime reads only %s", f.Path, install.PluginType, used.Path)})
		}
	}
	return out
}

func checkAgent(ctx context.Context, n *node) []Finding {
	if n.cfg.Agent == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	st, err := n.cfg.Agent(ctx)
	switch {
	case err != nil:
		return []Finding{{Check: "agent", Status: Info, Summary: fmt.Sprintf("the agent does not answer: %v", err),
			Meaning: "before install, or while it restarts, this is expected: pinned redirection keeps working, but new ambient pods fail to start until it is back"}}
	case !st.Ready:
		return []Finding{{Check: "agent", Status: Warn, Summary: "the agent is not ready: " + st.NotReadyReason,
			Meaning: "new ambient pods fail to start until it is (fail closed)"}}
	}
	return []Finding{{Check: "agent", Status: OK, Summary: fmt.Sprintf("the agent is ready on node %s: %d pods enrolled, %d ztunnel connections", st.Node, st.EnrolledPods, st.ZtunnelConnections)}}
}
