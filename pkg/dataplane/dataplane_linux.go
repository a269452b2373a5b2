// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/rlimit"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/upgrade"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// cgroupTarget is a cgroup v2 directory the socket programs attach to.
type cgroupTarget struct {
	path string
	id   uint64
}

// nodeScopePrograms are the node-wide half of a split attach: bpf/sock.c
// loaded a second time with AE_CFG_NODE_SCOPE, only the programs of
// bpfobj.NodeScopeHooks (the others are never loaded).
type nodeScopePrograms struct {
	Connect4 *ebpf.Program `ebpf:"ae_connect4"`
	Connect6 *ebpf.Program `ebpf:"ae_connect6"`
	Sockops  *ebpf.Program `ebpf:"ae_sockops"`
	// NodeNetnsCookie is its own copy of ae_node_netns_cookie.
	NodeNetnsCookie *ebpf.Variable `ebpf:"ae_node_netns_cookie"`
}

func (p *nodeScopePrograms) program(name string) *ebpf.Program {
	switch strings.TrimPrefix(name, bpfobj.NodeScopePrefix) {
	case "connect4":
		return p.Connect4
	case "connect6":
		return p.Connect6
	}
	return p.Sockops
}

func (p *nodeScopePrograms) Close() {
	if p == nil {
		return
	}
	for _, prog := range []*ebpf.Program{p.Connect4, p.Connect6, p.Sockops} {
		if prog != nil {
			prog.Close()
		}
	}
}

// Dataplane is the loaded data path. All methods are safe for concurrent
// use; mutations run one at a time.
type Dataplane struct {
	cfg Config
	log *slog.Logger

	// Mechanisms picked from the kernel's features, once, in New.
	hooks tcHooks // how TC programs are attached (classic tc filters)
	// skLookupInbound: the pod's sk_lookup program alone captures inbound
	// flows (Linux 5.17 gives it the ingress interface).
	skLookupInbound bool
	netnsCookie     func() (uint64, error) // of the calling thread's netns
	bpfFlags        uint32                 // ae_cfg.flags
	nsQuery         link.Link              // ae_netns_query, where SO_NETNS_COOKIE is missing
	listenerIter    *ebpf.Program          // ae_file_listeners, in the sk_lookup mode
	probeConnect    *ebpf.Program          // ae_probe_connect, where probesAtConnect
	nodeNetns       []netnsID              // never a pod's (refuseNodeNetns)
	// kernelBTF is decoded once for every collection New loads (up to
	// seven: each would otherwise decode the kernel's BTF again, the
	// largest part of a load's own CPU), and let go when New returns:
	// nothing is loaded later, and the decoded types would stay in the
	// agent's memory for its lifetime.
	kernelBTF *btf.Cache

	// upgrade is what New found of the pins' layout (package upgrade);
	// used from load until the links run the new programs, nil afterwards.
	upgrade *upgrade.Plan

	// Where the socket programs attach: all of them to hooksAt (the
	// pods' cgroup when Config.PodsCgroup is set, else the root), and
	// with a pods' cgroup, the node-wide half (nodeScope) to root.
	root, hooksAt cgroupTarget

	mu        sync.Mutex
	sock      bpfobj.SockObjects
	nodeScope *nodeScopePrograms // nil without a pods' cgroup
	tc        bpfobj.TcObjects
	nodeLinks []link.Link
	nodeNL    *netlink.Handle      // in the node netns, once needed (nodeNetlink)
	pods      map[string]*podState // by UID
	// leaveReturnPaths: removals keep the pods' return paths (LeaveReturnPaths).
	leaveReturnPaths bool
	slots            slotAllocator
	// The sockmap acceleration (accel_linux.go): nil unless it runs.
	accel       *accel.Accel
	accelStatus accel.Status
}

type podState struct {
	inspect.EnrolledPod
	netnsPath   string
	savedFwmark uint32
	ifindex     uint32               // of the pod interface, in its netns
	journal     uint32               // bpfobj.MetaEnrolled, or where a stopped agent left it
	links       map[string]tcProgram // by pin name; adopted pins that could not be loaded are missing
}

// nodeHook is one of the node-wide cgroup attachments.
type nodeHook struct {
	name   string
	attach ebpf.AttachType
	prog   *ebpf.Program
}

// New loads the programs, reuses the pinned maps (creating them on first
// start), attaches or adopts the node-wide hooks and adopts every pod
// enrolled before. Every path is checked before the kernel is touched, and
// on error nothing it created is left behind: on a first start no pin
// remains; with pins of an earlier agent, those stay as they were.
func New(cfg Config) (*Dataplane, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	rootID, err := hostfs.CgroupID(cfg.CgroupRoot)
	if err != nil {
		return nil, fmt.Errorf("cgroup root: %w", err)
	}
	root := cgroupTarget{cfg.CgroupRoot, rootID}
	hooksAt := root
	if cfg.PodsCgroup != "" {
		id, err := hostfs.CgroupID(cfg.PodsCgroup)
		if err != nil {
			return nil, fmt.Errorf("pods cgroup: %w", err)
		}
		hooksAt = cgroupTarget{cfg.PodsCgroup, id}
	}
	if mounted, err := hostfs.EnsureBPFFS(filepath.Dir(cfg.BPFFSDir)); err != nil {
		return nil, err
	} else if mounted {
		cfg.Logger.Info("mounted a bpffs: none was there", "path", filepath.Dir(cfg.BPFFSDir))
	}
	if _, err := os.Stat(cfg.NodeNetns); err != nil {
		return nil, fmt.Errorf("node netns: %w", err)
	}
	// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK, per user:
	// pins another process left count too, so the feature probes (which
	// load programs and maps) come after it.
	if err := rlimit.RemoveMemlock(); err != nil {
		return nil, fmt.Errorf("remove memlock limit: %w", err)
	}
	if err := features.CheckRequired(); err != nil {
		return nil, err
	}
	_, statErr := os.Stat(cfg.BPFFSDir)
	fresh := errors.Is(statErr, os.ErrNotExist)
	d, err := load(cfg, root, hooksAt)
	if err != nil && fresh {
		_ = os.RemoveAll(cfg.BPFFSDir)
	}
	return d, fdlimit.Annotate(err)
}

func load(cfg Config, root, hooksAt cgroupTarget) (*Dataplane, error) {
	// Pins this build cannot take over are refused before anything
	// is created.
	if err := upgrade.Check(cfg.BPFFSDir); err != nil {
		return nil, err
	}
	for _, dir := range []string{mapsDir(cfg), linksDir(cfg), podsDir(cfg)} {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("create pin directory: %w", err)
		}
	}
	nodeNetns, err := nodeNetnsIDs(cfg)
	if err != nil {
		return nil, err
	}
	d := &Dataplane{cfg: cfg, log: cfg.Logger, pods: map[string]*podState{}, nodeNetns: nodeNetns, root: root, hooksAt: hooksAt,
		kernelBTF: cfg.KernelBTF}
	if d.kernelBTF == nil {
		d.kernelBTF = btf.NewCache()
	}
	defer func() { d.kernelBTF = nil }()
	d.pickMechanisms()
	if err := d.load(); err != nil {
		return nil, err
	}
	if err := d.loadListenerIterator(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.loadProbeConnect(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.attachNetnsQuery(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.setNodeNetns(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.attachProbeConnect(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.attachNodeHooks(); err != nil {
		d.closeObjects()
		return nil, err
	}
	if err := d.removeProbeConnect(); err != nil {
		d.closeObjects()
		return nil, err
	}
	d.accel, d.accelStatus = accel.Setup(accel.Options{
		Mode: d.cfg.SockmapAccel, BPFFSDir: d.cfg.BPFFSDir, CgroupRoot: d.hooksAt.path, CgroupID: d.hooksAt.id,
		Config: d.loadConfig(), Log: d.log, KernelBTF: d.kernelBTF,
	})
	if err := d.adoptPods(); err != nil {
		d.Close()
		return nil, err
	}
	d.settleZtunnelLinks()
	err = d.upgrade.Finish()
	d.upgrade.Close()
	d.upgrade = nil
	if err != nil {
		d.Close()
		return nil, fmt.Errorf("migrate the pinned data path: %w", err)
	}
	return d, nil
}

// nodeHookNames are the pins of every node-wide link this build may keep,
// the split attach's node half included.
func (d *Dataplane) nodeHookNames() []string {
	var out []string
	for _, h := range slices.Concat(bpfobj.NodeHooks(), bpfobj.NodeScopeHooks()) {
		out = append(out, h.Name)
	}
	return append(out, bpfobj.ProbeConnectPin)
}

// pickMechanisms chooses, from the kernel's features, how TC programs are
// attached, how netns cookies are read and which helpers the programs may
// call (see docs/KERNELS.md).
func (d *Dataplane) pickMechanisms() {
	d.hooks, d.netnsCookie = pickTCHooks(), nsexec.Cookie
	if !features.HasSONetnsCookie() {
		d.netnsCookie = d.queryNetnsCookie
	}
	if features.HasNetnsCookieSockops() {
		d.bpfFlags |= bpfobj.CfgNetnsCookieSockops
	}
	if features.HasNetnsCookieSockopt() {
		d.bpfFlags |= bpfobj.CfgNetnsCookieSockopt
	}
	// tc's bpf_sk_assign takes reuseport listeners (all of ztunnel's are)
	// since 6.5. That cannot be probed by loading a program, and kernel
	// BTF misleads (Debian's 6.1 has the 6.5 helper function names), so
	// it is inferred from TCX (6.6): without TCX, sk_lookup hands over.
	if features.HasTCX() {
		d.bpfFlags |= bpfobj.CfgSkAssignReuseport
	}
	// sk_lookup captures inbound alone where it sees the ingress
	// interface and sockops can file ztunnel's listeners by netns.
	if features.HasSkLookupIfindex() && features.HasNetnsCookieSockops() {
		d.skLookupInbound = true
		d.bpfFlags |= bpfobj.CfgSkLookupIfindex
	}
	// The direct mode's host probes are filed at tcp_connect() where the
	// kernel takes fentry programs, instead of by socket programs on the
	// node's root that every TCP connection of the node would run
	// (probes_linux.go).
	if d.cfg.HostProbes == bpfobj.ProbeDirect && features.HasFentryTCPConnect() {
		if err := probeProgramLoads(d.kernelBTF); err != nil {
			d.log.Warn("host probes are filed by the node-wide half on the cgroup root: the kernel takes fentry, not bpf/probe.c", "error", err)
		} else {
			d.bpfFlags |= bpfobj.CfgProbeConnect
		}
	}
	d.log.Info("dataplane mechanisms", "sk_lookup_inbound", d.skLookupInbound, "tcx", features.HasTCX(), "so_netns_cookie", features.HasSONetnsCookie(),
		"netns_cookie_sockops", features.HasNetnsCookieSockops(), "netns_cookie_sockopt", features.HasNetnsCookieSockopt(),
		"host_probes_at_connect", d.probesAtConnect())
}

// attachNetnsQuery attaches ae_netns_query to the agent's own cgroup where
// the kernel lacks SO_NETNS_COOKIE; the link lives as long as the agent.
func (d *Dataplane) attachNetnsQuery() error {
	if features.HasSONetnsCookie() {
		return nil
	}
	cg, err := ownCgroup()
	if err != nil {
		return err
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cg, Attach: ebpf.AttachCGroupInet4Bind, Program: d.sock.AeNetnsQuery})
	if err != nil {
		return fmt.Errorf("attach netns cookie query to cgroup %s: %w", cg, err)
	}
	d.nsQuery = l
	return nil
}

// setNodeNetns tells the socket programs which netns is the node's: in
// the direct host-probe mode its sockets' connections to enrolled pods are
// host probes (bpf/sock.c). Before the hooks are attached.
func (d *Dataplane) setNodeNetns() error {
	var cookie uint64
	err := nsexec.Do(d.cfg.NodeNetns, func() (err error) { cookie, err = d.netnsCookie(); return err })
	if err != nil {
		return fmt.Errorf("read the cookie of the node netns %s: %w", d.cfg.NodeNetns, err)
	}
	if err := d.sock.AeNodeNetnsCookie.Set(cookie); err != nil {
		return fmt.Errorf("write ae_node_netns_cookie: %w", err)
	}
	if d.nodeScope != nil {
		if err := d.nodeScope.NodeNetnsCookie.Set(cookie); err != nil {
			return fmt.Errorf("write the node-wide programs' ae_node_netns_cookie: %w", err)
		}
	}
	return nil
}

func mapsDir(cfg Config) string            { return bpfobj.MapsDir(cfg.BPFFSDir) }
func linksDir(cfg Config) string           { return bpfobj.LinksDir(cfg.BPFFSDir) }
func podsDir(cfg Config) string            { return bpfobj.PodsDir(cfg.BPFFSDir) }
func podDir(cfg Config, uid string) string { return bpfobj.PodDir(cfg.BPFFSDir, uid) }

// loadConfig is ae_cfg as every object is loaded with it: the node's
// settings and the mechanisms this kernel has.
func (d *Dataplane) loadConfig() bpfobj.SockAeConfig {
	c := d.cfg.bpfConfig()
	c.Flags |= d.bpfFlags
	return c
}

// AccelStatus reports the sockmap acceleration's state.
func (d *Dataplane) AccelStatus() accel.Status {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.accelStatus
}

func (d *Dataplane) load() error {
	bpfCfg := d.loadConfig()

	sockSpec, err := bpfobj.LoadSock()
	if err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	var ss bpfobj.SockSpecs
	if err := sockSpec.Assign(&ss); err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	if err := ss.AeCfg.Set(bpfCfg); err != nil {
		return fmt.Errorf("configure socket programs: %w", err)
	}
	tracing := inspect.TraceFlagAtLoad(d.cfg.BPFFSDir)
	if err := pinTraceFlag(sockSpec, ss.AeTracing, tracing); err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	tcSpec, err := bpfobj.LoadTc()
	if err != nil {
		return fmt.Errorf("read tc programs: %w", err)
	}
	var ts bpfobj.TcSpecs
	if err := tcSpec.Assign(&ts); err != nil {
		return fmt.Errorf("read tc programs: %w", err)
	}
	if err := ts.AeCfg.Set(bpfCfg); err != nil {
		return fmt.Errorf("configure tc programs: %w", err)
	}
	if err := pinTraceFlag(tcSpec, ts.AeTracing, tracing); err != nil {
		return fmt.Errorf("read tc programs: %w", err)
	}
	if !features.HasTCX() {
		// Classic tc programs carry no attach type; kernels before TCX
		// refuse one they do not know.
		for _, p := range tcSpec.Programs {
			if p.Type == ebpf.SchedCLS {
				p.AttachType = ebpf.AttachNone
			}
		}
	}

	// The pinned maps, of this layout or upgraded to it (package upgrade):
	// every one is filled before a program that uses it is loaded.
	up, err := upgrade.Prepare(upgrade.Config{
		BPFFSDir:    d.cfg.BPFFSDir,
		ForeignMaps: accel.MapPins(), // the acceleration adopts its own (accel.Setup)
		Links:       append(d.nodeHookNames(), accel.SockopsPin, accel.MsgPin),
		Logger:      d.log,
		Failpoint:   d.cfg.Failpoint,
	}, sockSpec, tcSpec)
	if err != nil {
		return err
	}
	// A loader writes a data section's contents only into a map it
	// creates itself.
	if m := up.Map(bpfobj.TraceFlagMap); m != nil {
		if err := m.Put(uint32(0), tracing); err != nil {
			up.Close()
			return fmt.Errorf("write %s: %w", bpfobj.TraceFlagMap, err)
		}
	}
	d.upgrade = up

	opts := func(cs *ebpf.CollectionSpec) *ebpf.CollectionOptions {
		return &ebpf.CollectionOptions{Maps: ebpf.MapOptions{PinPath: mapsDir(d.cfg)}, MapReplacements: up.Replacements(cs), Cache: d.kernelBTF}
	}
	if err := sockSpec.LoadAndAssign(&d.sock, opts(sockSpec)); err != nil {
		d.logVerifier(err)
		up.Close()
		return fmt.Errorf("load socket programs: %w", err)
	}
	if err := d.sock.AeNodeCfg.Put(uint32(0), &bpfCfg); err != nil {
		d.sock.Close()
		up.Close()
		return fmt.Errorf("write ae_node_cfg: %w", err)
	}
	if d.cfg.PodsCgroup != "" && !d.probesAtConnect() {
		if err := d.loadNodeScope(bpfCfg, tracing, opts); err != nil {
			d.sock.Close()
			up.Close()
			return err
		}
	}
	if err := tcSpec.LoadAndAssign(&d.tc, opts(tcSpec)); err != nil {
		d.sock.Close()
		up.Close()
		d.logVerifier(err)
		return fmt.Errorf("load tc programs: %w", err)
	}
	return nil
}

// loadNodeScope loads the node-wide half of a split attach: the socket
// programs again, with AE_CFG_NODE_SCOPE, on the same pinned maps.
func (d *Dataplane) loadNodeScope(bpfCfg bpfobj.SockAeConfig, tracing uint32, opts func(*ebpf.CollectionSpec) *ebpf.CollectionOptions) error {
	spec, err := bpfobj.LoadSock()
	if err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	var ss bpfobj.SockSpecs
	if err := spec.Assign(&ss); err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	bpfCfg.Flags |= bpfobj.CfgNodeScope
	if err := ss.AeCfg.Set(bpfCfg); err != nil {
		return fmt.Errorf("configure the node-wide socket programs: %w", err)
	}
	if err := pinTraceFlag(spec, ss.AeTracing, tracing); err != nil {
		return fmt.Errorf("read socket programs: %w", err)
	}
	var p nodeScopePrograms
	if err := spec.LoadAndAssign(&p, opts(spec)); err != nil {
		d.logVerifier(err)
		return fmt.Errorf("load the node-wide socket programs: %w", err)
	}
	d.nodeScope = &p
	return nil
}

func (d *Dataplane) logVerifier(err error) {
	var ve *ebpf.VerifierError
	if errors.As(err, &ve) {
		d.log.Error("verifier rejected a program", "log", fmt.Sprintf("%+v", ve))
	}
}

func (d *Dataplane) closeObjects() {
	d.accel.Close()
	d.accel = nil
	if d.upgrade != nil {
		d.upgrade.Close()
		d.upgrade = nil
	}
	if d.nsQuery != nil {
		d.nsQuery.Close()
		d.nsQuery = nil
	}
	if d.listenerIter != nil {
		d.listenerIter.Close()
		d.listenerIter = nil
	}
	if d.probeConnect != nil {
		d.probeConnect.Close()
		d.probeConnect = nil
	}
	d.sock.Close()
	d.nodeScope.Close()
	d.nodeScope = nil
	d.tc.Close()
}

func (d *Dataplane) nodeHooks() []nodeHook {
	var hooks []nodeHook
	for _, h := range bpfobj.NodeHooks() {
		hooks = append(hooks, nodeHook{h.Name, h.Attach, h.Program(&d.sock.SockPrograms)})
	}
	return hooks
}

// attachNodeHooks attaches the socket programs to their cgroup (hooksAt),
// and with a pods' cgroup the node-wide half to the root, or swaps the new
// programs into links pinned by an earlier agent: an atomic replace, so no
// connect() runs without a program. A link an earlier agent pinned on the
// other of the two cgroups (the pods' cgroup was set or unset since) is
// moved: the new link is attached first, then takes the old one's pin,
// which detaches the old one. Node-wide links a split attach no longer
// needs are removed. Nothing changes unless every link could be made.
func (d *Dataplane) attachNodeHooks() error {
	// A pinned link elsewhere is the earlier agent's pods' cgroup, or the
	// root it attached to before it had one; any other is refused. The
	// earlier agent's pods' cgroup is below the root: where it filed host
	// probes at tcp_connect, no node-wide half on the root says so.
	_, err := os.Stat(filepath.Join(linksDir(d.cfg), bpfobj.NodeScopeHooks()[0].Name))
	wasSplit := err == nil
	movable := func(l link.Link) bool {
		return wasSplit || d.hooksAt != d.root && bpfobj.SameCgroup(l, d.root.id) == nil || linkedBelow(l, d.root.path)
	}
	var staged []stagedHook
	rollback := func() {
		for _, h := range staged {
			h.abandon()
		}
	}
	perPod := d.cfg.SocketHooks == SocketHooksPods
	if perPod {
		if err := d.refuseSharedHooksInUse(); err != nil {
			return err
		}
	} else {
		full, err := d.stageHooks(d.nodeHooks(), d.hooksAt, movable)
		staged = append(staged, full...)
		if err != nil {
			rollback()
			return err
		}
	}
	if d.nodeScope != nil {
		var hooks []nodeHook
		for _, h := range bpfobj.NodeScopeHooks() {
			hooks = append(hooks, nodeHook{h.Name, h.Attach, d.nodeScope.program(h.Name)})
		}
		half, err := d.stageHooks(hooks, d.root, func(link.Link) bool { return false })
		staged = append(staged, half...)
		if err != nil {
			rollback()
			return err
		}
	}
	for _, h := range staged {
		if err := h.commit(); err != nil {
			// The links committed so far run the new programs; the
			// rest still run the old ones where they were.
			rollback()
			return err
		}
		d.nodeLinks = append(d.nodeLinks, h.link)
	}
	if perPod {
		// No pod is enrolled (refuseSharedHooksInUse): nothing of the
		// shared set is needed.
		for _, h := range bpfobj.NodeHooks() {
			pin := filepath.Join(linksDir(d.cfg), h.Name)
			if _, err := os.Stat(pin); err == nil {
				d.log.Info("removing a shared socket program: the socket hooks are per pod", "link", h.Name)
				if err := pinnedLink(pin).detach(); err != nil {
					return err
				}
			}
		}
	}
	if d.nodeScope == nil {
		for _, h := range bpfobj.NodeScopeHooks() {
			pin := filepath.Join(linksDir(d.cfg), h.Name)
			if _, err := os.Stat(pin); err == nil {
				d.log.Info("removing a node-wide link of a split attach: no pods cgroup is configured, or host probes are filed at connect", "link", h.Name)
				if err := pinnedLink(pin).detach(); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// refuseSharedHooksInUse refuses the per-pod socket hooks on pins of the
// shared ones with pods enrolled: their sockets would meet no program
// until each pod's cgroup had its own, and ztunnel's, whose reads of
// original destinations need them, none until it connects again.
func (d *Dataplane) refuseSharedHooksInUse() error {
	if _, err := os.Stat(filepath.Join(linksDir(d.cfg), bpfobj.NodeHooks()[0].Name)); err != nil {
		return nil
	}
	entries, _ := os.ReadDir(podsDir(d.cfg))
	if len(entries) == 0 {
		return nil
	}
	return fmt.Errorf("the pins under %s hold shared socket hooks and %d enrolled pods: per-pod socket hooks start on a node without enrolled pods (drain it, or run this agent with shared socket hooks)", d.cfg.BPFFSDir, len(entries))
}

// stagedHook is a socket program's link made ready by stageHooks and
// made the pinned one by commit.
type stagedHook struct {
	pin  string
	link link.Link
	// next is the temporary pin of a new link that replaces old, a pinned
	// one of the other cgroup; "" when link is the pinned one already.
	next  string
	old   link.Link
	fresh bool // link was attached (and pinned) by this agent
}

// commit makes the staged link the pinned one: a moved link's pin
// replaces the old pin in one rename, and the old link is detached.
func (h stagedHook) commit() error {
	if h.next == "" {
		return nil
	}
	if err := os.Rename(h.next, h.pin); err != nil {
		return fmt.Errorf("move the %s link to its pin: %w", filepath.Base(h.pin), err)
	}
	_ = h.old.Detach() // BPF_LINK_DETACH (5.9+): gone even if someone holds it
	h.old.Close()
	return nil
}

// abandon undoes what stageHooks did for the hook: a link it attached
// goes, with its pin; an adopted one is only closed.
func (h stagedHook) abandon() {
	switch {
	case h.next != "":
		_ = os.Remove(h.next)
		h.old.Close()
	case h.fresh:
		_ = h.link.Unpin()
	}
	h.link.Close()
}

// stageHooks attaches or adopts each of hooks at cgroup at. A pinned link
// elsewhere that movable accepts gets a new link at at, pinned aside.
func (d *Dataplane) stageHooks(hooks []nodeHook, at cgroupTarget, movable func(link.Link) bool) ([]stagedHook, error) {
	var out []stagedHook
	for _, h := range hooks {
		pin := filepath.Join(linksDir(d.cfg), h.name)
		l, err := link.LoadPinnedLink(pin, nil)
		switch {
		case err == nil:
			if bpfobj.SameCgroup(l, at.id) == nil {
				if err := l.Update(h.prog); err != nil {
					l.Close()
					return out, fmt.Errorf("update pinned %s link: %w", h.name, err)
				}
				out = append(out, stagedHook{pin: pin, link: l})
				continue
			}
			if !movable(l) {
				err := bpfobj.SameCgroup(l, at.id)
				l.Close()
				return out, fmt.Errorf("pinned %s hook %w: the cgroup root changed since the data path was installed; start with the earlier root or uninstall first", h.name, err)
			}
			d.log.Info("moving a socket program's link: the pods' cgroup changed", "hook", h.name, "to", at.path)
			nl, err := d.attachHook(h, at)
			if err != nil {
				l.Close()
				return out, err
			}
			// bpffs refuses a '.' in a name.
			next := filepath.Join(filepath.Dir(pin), "moving_"+h.name)
			_ = os.Remove(next)
			if err := nl.Pin(next); err != nil {
				nl.Close()
				l.Close()
				return out, fmt.Errorf("pin %s link: %w", h.name, err)
			}
			out = append(out, stagedHook{pin: pin, link: nl, next: next, old: l, fresh: true})
		case errors.Is(err, os.ErrNotExist):
			nl, err := d.attachHook(h, at)
			if err != nil {
				return out, err
			}
			if err := nl.Pin(pin); err != nil {
				nl.Close()
				return out, fmt.Errorf("pin %s link: %w", h.name, err)
			}
			out = append(out, stagedHook{pin: pin, link: nl, fresh: true})
		default:
			return out, fmt.Errorf("load pinned %s link: %w", h.name, err)
		}
	}
	return out, nil
}

// attachHook attaches one socket program to a cgroup, naming whatever
// holds the hook alone when the kernel refuses.
func (d *Dataplane) attachHook(h nodeHook, at cgroupTarget) (link.Link, error) {
	l, err := link.AttachCgroup(link.CgroupOptions{Path: at.path, Attach: h.attach, Program: h.prog})
	if err != nil {
		return nil, fmt.Errorf("attach %s to cgroup %s: %w%s", h.name, at.path, err, exclusiveHolder(at.path, err))
	}
	return l, nil
}

// exclusiveHolder names, for an attach the kernel refused with EPERM, the
// program that holds the hook alone (attached without BPF_F_ALLOW_MULTI),
// and what to do about it; "" when there is none to name.
func exclusiveHolder(cgroup string, err error) string {
	if !errors.Is(err, unix.EPERM) {
		return ""
	}
	mount, _ := hostfs.Cgroup2Root()
	holders, _ := inspect.ExclusiveHolders(mount, cgroup)
	if len(holders) == 0 {
		return ""
	}
	return fmt.Sprintf(": %s, which keeps every other program off the hook; ambient-ebpf cannot run beside it: have its owner attach with BPF_F_ALLOW_MULTI or a bpf_link (Cilium's socket load balancer does from 1.14), or detach it", holders[0])
}

// Close releases the agent's handles and leaves every pin in place, so
// redirection continues while no agent runs.
func (d *Dataplane) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, l := range d.nodeLinks {
		l.Close()
	}
	d.nodeLinks = nil
	if d.nodeNL != nil {
		d.nodeNL.Close()
		d.nodeNL = nil
	}
	d.pods = map[string]*podState{}
	d.closeObjects()
	return nil
}

// Uninstall removes the data path from the node: every link (which
// detaches the programs), every pin and the pin directory. Pods' traffic
// flows directly afterwards (or through istio-cni's rules, after a
// hand-back).
//
// Capture ends first, in every pod at once; then, before any program
// goes, ztunnel gets the time to read the original destinations of the
// connections captured just before (awaitOrigDstReads): without
// cgroup/getsockopt it would be told the address the socket was
// redirected to, and the connection would fail.
func (d *Dataplane) Uninstall() error {
	d.mu.Lock()
	for _, p := range d.pods {
		d.deleteOwnedNetns(p)
	}
	d.cfg.failpoint(StepUninstallCaptureEnded)
	if len(d.nodeLinks) > 0 { // not after Close
		d.awaitOrigDstReads()
	}
	var errs []error
	for uid, p := range d.pods {
		if err := d.detachPod(p, false); err != nil {
			errs = append(errs, err)
		}
		delete(d.pods, uid)
	}
	for _, l := range d.nodeLinks {
		// Detached here, not when the last reference goes: that may be
		// another process's, or the kernel's a moment later (seen on
		// 5.10, where the root kept the node-wide half after Uninstall).
		_ = l.Detach()
		if err := l.Unpin(); err != nil {
			errs = append(errs, err)
		}
		l.Close()
	}
	d.nodeLinks = nil
	// ztunnel's cgroups' links (per-pod socket hooks) last: its reads of
	// original destinations need them until here.
	if err := d.detachZtunnelLinks(); err != nil {
		errs = append(errs, err)
	}
	if err := accel.Uninstall(d.cfg.BPFFSDir); err != nil {
		errs = append(errs, err)
	}
	d.mu.Unlock()
	if err := d.Close(); err != nil {
		errs = append(errs, err)
	}
	if err := os.RemoveAll(d.cfg.BPFFSDir); err != nil {
		errs = append(errs, fmt.Errorf("remove %s: %w", d.cfg.BPFFSDir, err))
	}
	return errors.Join(errs...)
}

// awaitOrigDstReads waits, up to Config.UnreadOrigDstWait, until ztunnel
// has read every original destination filed in ae_orig_dst (their read
// flag), or their connections closed (sockops deletes the entry). Capture
// has ended, so no new entry is filed once a connect under way passes
// sockops (origDstSettle). An entry nobody reads (a connection whose
// proxy never asks, or that sits in a stalled ztunnel's backlog) costs the
// whole wait, once.
func (d *Dataplane) awaitOrigDstReads() {
	time.Sleep(origDstSettle)
	deadline := time.Now().Add(d.cfg.UnreadOrigDstWait)
	start, first := time.Now(), -1
	for {
		unread := d.unreadOrigDsts()
		if first < 0 {
			first = unread
		}
		if unread == 0 {
			if first > 0 {
				d.log.Info("ztunnel read the original destinations of connections captured before the uninstall", "connections", first, "waited", time.Since(start).Round(time.Millisecond))
			}
			return
		}
		if time.Now().After(deadline) {
			d.log.Warn("uninstalling with original destinations ztunnel has not read: those connections will fail", "unread", unread, "of", first, "waited", d.cfg.UnreadOrigDstWait)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// origDstSettle is how long a connect() that passed cgroup/connect before
// capture ended may take to file its entry at TCP_CONNECT_CB: the same
// system call, microseconds apart.
const origDstSettle = 20 * time.Millisecond

// unreadOrigDsts counts the ae_orig_dst entries ztunnel has not read.
func (d *Dataplane) unreadOrigDsts() int {
	var (
		k bpfobj.SockOrigKey
		v bpfobj.SockOrigDst
		n int
	)
	it := d.sock.AeOrigDst.Iterate()
	for it.Next(&k, &v) {
		if v.Pad == 0 { // the read flag (bpf/include/common.h)
			n++
		}
	}
	if err := it.Err(); err != nil {
		d.log.Warn("uninstall: read ae_orig_dst", "error", err)
		return 0
	}
	return n
}

// pinTraceFlag turns the data section holding ae_tracing (bpf/include/trace.h)
// into a map pinned as maps/ae_tracing, so both objects and every tracer
// share one flag, and loads it with value on: the loader writes a data
// section's contents on every load, pinned or not.
func pinTraceFlag(spec *ebpf.CollectionSpec, v *ebpf.VariableSpec, on uint32) error {
	ms := spec.Maps[v.SectionName]
	if ms == nil {
		return fmt.Errorf("no map holds section %s", v.SectionName)
	}
	ms.Name = bpfobj.TraceFlagMap
	ms.Pinning = ebpf.PinByName
	return v.Set(on)
}

// Decisions reads the programs' decision counters.
func (d *Dataplane) Decisions() (inspect.Decisions, error) {
	return inspect.ReadDecisions(&d.sock.SockMaps)
}
