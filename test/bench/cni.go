// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/containernetworking/cni/libcni"
	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/test/cniexec"
	"github.com/ambient-ebpf/ambient-ebpf/test/reference/rules"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// cniRuntime is the container runtime's side of CNI, a helper in the node
// netns: it execs a chained plugin for each pod the way containerd does
// through libcni (the conflist entry with name, cniVersion and the primary
// plugin's prevResult injected on stdin; CNI_* in the environment), with a
// number of calls in flight, and times each from the exec to the plugin's
// exit 0 and the check that redirection is in place (or gone, after DEL).
type cniRuntime struct{}

// cniPod is a pod as the runtime knows it.
type cniPod = cniexec.Pod

func toCNIPods(pods []*simnode.Pod) []cniPod { return cniexec.FromSimnode(pods...) }

// How a call proves redirection.
const (
	// checkNetns: the pod's netns cookie is a key of the pinned ae_netns
	// map (ADD) or no longer is (DEL), looked up in the timed window right
	// after the exit; after the batch the dataplane's read-only pinned view
	// must list the pod with that cookie (or not at all).
	checkNetns = "netns"
	// checkIptables: nothing in the timed window (the plugin exits after
	// iptables-restore committed the rules); after the batch iptables-save
	// must show the rules in every pod and the ipsets its addresses.
	checkIptables = "iptables"
	// checkInpod: the real istio-cni's agent commits the pod's rules
	// before its plugin exits; in the timed window right after the exit,
	// nf_tables (over netlink, in the pod's netns) must hold its
	// ISTIO_OUTPUT chain in the nat table of both families. After the
	// batch, as checkIptables.
	checkInpod = "inpod"
)

type cniRequest struct {
	// Command is ADD, DEL or VERSION (the plugin's start alone).
	Command  string          `json:"command"`
	Conflist json.RawMessage `json:"conflist"`
	// Plugin is the type of the list's plugin to exec; those before it
	// are the primary CNI, whose result the pods' addresses stand for.
	Plugin string   `json:"plugin"`
	BinDir string   `json:"binDir"` // CNI_PATH
	Conc   int      `json:"conc"`   // calls in flight
	Check  string   `json:"check"`
	BPFFS  string   `json:"bpffs,omitempty"` // checkNetns: the agent's pins
	Pods   []cniPod `json:"pods"`
}

type cniResult struct {
	// Latencies are per pod, in request order: exec to exit 0 plus the
	// check (retries included).
	Latencies []time.Duration `json:"latencies"`
	Total     time.Duration   `json:"total"` // the whole batch
	// PluginCPU is the user and system time of the plugin processes and
	// of what they ran (iptables-restore).
	PluginCPU time.Duration `json:"pluginCpu"`
	// Late counts checks that did not hold at the plugin's exit and were
	// polled until they did.
	Late int `json:"late"`
	// Retried counts ADDs that failed and were retried after a DEL, as
	// kubelet retries a sandbox; FirstError is the first such failure.
	Retried    int    `json:"retried"`
	FirstError string `json:"firstError,omitempty"`
}

// addAttempts bounds the ADDs of one pod; retries wait addBackoff,
// doubling, as kubelet backs off a sandbox that failed.
const (
	addAttempts = 5
	addBackoff  = 500 * time.Millisecond
)

func (cniRuntime) handle(line []byte) (any, error) {
	req, err := decode[cniRequest](line)
	if err != nil {
		return nil, err
	}
	return runCNI(req)
}

func runCNI(req cniRequest) (cniResult, error) {
	var res cniResult
	list, err := libcni.NetworkConfFromBytes(req.Conflist)
	if err != nil {
		return res, fmt.Errorf("parse conflist: %w", err)
	}
	var chk checker = noCheck{}
	switch {
	case req.Command == "VERSION":
	case req.Check == checkIptables:
		chk = iptablesCheck{}
	case req.Check == checkInpod:
		chk = inpodCheck{pods: req.Pods}
	case req.Check == checkNetns:
		nc, err := newNetnsCheck(req.BPFFS, req.Pods)
		if err != nil {
			return res, err
		}
		defer nc.close()
		chk = nc
	}
	calls := make([]*cniCall, len(req.Pods))
	for j, p := range req.Pods {
		c, err := cniexec.NewCall(list, req.Plugin, req.BinDir, p)
		if err != nil {
			return res, err
		}
		calls[j] = &cniCall{c}
	}

	res.Latencies = make([]time.Duration, len(calls))
	var (
		mu       sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	work := make(chan int)
	cpu0 := childrenCPU()
	start := time.Now()
	for range max(req.Conc, 1) {
		wg.Go(func() {
			for j := range work {
				d, late, retried, err := calls[j].run(req.Command, func() (bool, error) { return chk.holds(req.Command, j) })
				mu.Lock()
				res.Latencies[j] = d
				if late {
					res.Late++
				}
				res.Retried += len(retried)
				if len(retried) > 0 && res.FirstError == "" {
					res.FirstError = retried[0].Error()
				}
				if err != nil && firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
			}
		})
	}
	for j := range calls {
		work <- j
	}
	close(work)
	wg.Wait()
	res.Total = time.Since(start)
	res.PluginCPU = childrenCPU() - cpu0
	if firstErr != nil {
		return res, firstErr
	}
	return res, chk.verify(req.Command, req.Pods)
}

// cniCall is one pod's exec, prepared before the clock runs.
type cniCall struct{ *cniexec.Call }

// run execs the plugin and waits for holds; an ADD that fails is undone
// with a DEL and tried again after a backoff, up to addAttempts times.
func (c *cniCall) run(cmd string, holds func() (bool, error)) (d time.Duration, late bool, retried []error, err error) {
	t0 := time.Now()
	for attempt, backoff := 1, addBackoff; ; attempt, backoff = attempt+1, 2*backoff {
		err = c.exec(cmd)
		if err == nil || cmd != "ADD" || attempt == addAttempts {
			break
		}
		retried = append(retried, err)
		if derr := c.exec("DEL"); derr != nil {
			return time.Since(t0), false, retried, fmt.Errorf("%s: DEL after a failed ADD: %w", c.Pod.Name, derr)
		}
		time.Sleep(backoff)
	}
	if err != nil {
		return time.Since(t0), false, retried, fmt.Errorf("%s %s: %w", cmd, c.Pod.Name, err)
	}
	ok, err := holds()
	for deadline := time.Now().Add(5 * time.Second); err == nil && !ok; ok, err = holds() {
		late = true
		if time.Now().After(deadline) {
			return time.Since(t0), late, retried, fmt.Errorf("%s %s: the plugin exited 0, but redirection did not follow within 5 s", cmd, c.Pod.Name)
		}
		time.Sleep(100 * time.Microsecond)
	}
	return time.Since(t0), late, retried, err
}

func (c *cniCall) exec(cmd string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return c.Exec(ctx, cmd)
}

// childrenCPU is the user and system time of this process's ended children.
func childrenCPU() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_CHILDREN, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// checker proves a call's effect: holds in the timed window, verify for
// the whole batch afterwards.
type checker interface {
	holds(cmd string, i int) (bool, error)
	verify(cmd string, pods []cniPod) error
}

// netnsCheck reads the agent's pinned ae_netns map (maps/ae_netns, keyed
// by netns cookie: pkg/dataplane's documented pin layout) read-only.
type netnsCheck struct {
	bpffs   string
	netns   *ebpf.Map
	cookies []uint64
}

func newNetnsCheck(bpffs string, pods []cniPod) (*netnsCheck, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(bpffs, "maps", "ae_netns"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		return nil, fmt.Errorf("open the pinned ae_netns map: %w", err)
	}
	c := &netnsCheck{bpffs: bpffs, netns: m, cookies: make([]uint64, len(pods))}
	for i, p := range pods {
		if c.cookies[i], err = netnsCookie(p.Netns); err != nil {
			m.Close()
			return nil, fmt.Errorf("netns cookie of %s: %w", p.Name, err)
		}
	}
	return c, nil
}

func (c *netnsCheck) close() { c.netns.Close() }

func (c *netnsCheck) holds(cmd string, i int) (bool, error) {
	v, err := c.netns.LookupBytes(c.cookies[i])
	if err != nil {
		return false, fmt.Errorf("look up netns cookie %d in ae_netns: %w", c.cookies[i], err)
	}
	return (v != nil) == (cmd == "ADD"), nil
}

func (c *netnsCheck) verify(cmd string, pods []cniPod) error {
	view, err := inspect.OpenPinned(c.bpffs)
	if err != nil {
		return err
	}
	defer view.Close()
	enrolled, err := view.Pods()
	if err != nil {
		return err
	}
	byUID := map[string]inspect.EnrolledPod{}
	for _, p := range enrolled {
		byUID[p.UID] = p
	}
	for i, p := range pods {
		ep, ok := byUID[p.UID]
		switch {
		case cmd == "ADD" && !ok:
			return fmt.Errorf("%s: enrolled, but the pinned maps do not list it", p.Name)
		case cmd == "ADD" && ep.NetnsCookie != c.cookies[i]:
			return fmt.Errorf("%s: the pinned maps name netns cookie %d, its netns has %d", p.Name, ep.NetnsCookie, c.cookies[i])
		case cmd == "DEL" && ok:
			return fmt.Errorf("%s: removed, but the pinned maps still list it", p.Name)
		}
	}
	return nil
}

// netnsCookie is the kernel's cookie of the netns at path (SO_NETNS_COOKIE
// of a socket made there).
func netnsCookie(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	ns, err := sockutil.EnterNetns(f)
	if err != nil {
		return 0, err
	}
	defer ns.Close()
	fd, err := ns.Socket(unix.AF_INET, unix.SOCK_DGRAM, sockutil.Opts{})
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
}

// noCheck checks nothing (VERSION).
type noCheck struct{}

func (noCheck) holds(string, int) (bool, error) { return true, nil }
func (noCheck) verify(string, []cniPod) error   { return nil }

// iptablesCheck verifies the reference plugin's work after the batch.
type iptablesCheck struct{}

func (iptablesCheck) holds(string, int) (bool, error) { return true, nil }

func (iptablesCheck) verify(cmd string, pods []cniPod) error {
	if cmd != "ADD" {
		return nil // the netns are going away: nothing to look at
	}
	sets := map[string]map[string]bool{}
	for _, name := range []string{rules.IpsetV4, rules.IpsetV6} {
		l, err := netlink.IpsetList(name)
		if err != nil {
			return fmt.Errorf("list ipset %s: %w", name, err)
		}
		sets[name] = map[string]bool{}
		for _, e := range l.Entries {
			sets[name][e.IP.String()] = true
		}
	}
	for _, p := range pods {
		for _, a := range p.IPs {
			tool, set := "iptables-save", rules.IpsetV4
			if a.Is6() {
				tool, set = "ip6tables-save", rules.IpsetV6
			}
			if !sets[set][a.String()] {
				return fmt.Errorf("%s: %s is not in ipset %s", p.Name, a, set)
			}
			out, err := exec.Command("nsenter", "--net="+p.Netns, tool, "-t", "nat").CombinedOutput()
			if err != nil {
				return fmt.Errorf("%s in %s: %w: %s", tool, p.Name, err, out)
			}
			if !strings.Contains(string(out), "-A OUTPUT -j ISTIO_OUTPUT") || !strings.Contains(string(out), "--to-ports 15001") {
				return fmt.Errorf("%s: %s shows no in-pod redirection:\n%s", p.Name, tool, out)
			}
		}
	}
	return nil
}

// inpodCheck proves the real istio-cni's in-pod rules: in the timed
// window, its nat chain in the pod's netns in both families, listed over
// netlink (iptables-nft's tables; iptables-restore commits a family's
// rules in one transaction); after the batch, as iptablesCheck.
type inpodCheck struct {
	iptablesCheck
	pods []cniPod
}

// inpodChain is the chain istio-cni's in-pod rules jump to from OUTPUT.
const inpodChain = "ISTIO_OUTPUT"

func (c inpodCheck) holds(cmd string, i int) (bool, error) {
	if cmd != "ADD" {
		return true, nil
	}
	ns, err := netns.GetFromPath(c.pods[i].Netns)
	if err != nil {
		return false, fmt.Errorf("open netns %s: %w", c.pods[i].Netns, err)
	}
	defer ns.Close()
	conn, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return false, fmt.Errorf("nftables in %s: %w", c.pods[i].Netns, err)
	}
	for _, family := range []nftables.TableFamily{nftables.TableFamilyIPv4, nftables.TableFamilyIPv6} {
		chains, err := conn.ListChainsOfTableFamily(family)
		if err != nil {
			return false, fmt.Errorf("list nftables chains in %s: %w", c.pods[i].Netns, err)
		}
		if !slices.ContainsFunc(chains, func(ch *nftables.Chain) bool { return ch.Table.Name == "nat" && ch.Name == inpodChain }) {
			return false, nil
		}
	}
	return true, nil
}
