// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package simnode builds a simulated Kubernetes node out of kernel objects
// the test owns: a node netns, an "outside" host netns, pod netns joined to
// the node by veth pairs (pod side eth0, /32 and /128 routes on the node, as
// ptp-style CNIs do), a cgroup v2 subtree with one cgroup per pod, and a
// private bpffs. Processes run in those netns and cgroups. Everything is
// named with a per-run prefix and removed by t.Cleanup, even on failure.
package simnode

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// TB is the part of testing.TB the harness uses, so programs other than
// tests (the demo) can build a node too.
type TB interface {
	Helper()
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	Errorf(format string, args ...any)
	Cleanup(func())
	TempDir() string
}

// Addresses of the simulated network (RFC 2544 benchmarking space).
var (
	GatewayV4 = netip.MustParseAddr("198.18.0.1") // node side of every pod veth
	GatewayV6 = netip.MustParseAddr("fd00:198:18::1")
	NodeV4    = netip.MustParseAddr("198.19.0.1") // node side of the outside link
	NodeV6    = netip.MustParseAddr("fd00:198:18:ff::1")
	OutsideV4 = netip.MustParseAddr("198.19.0.2") // the outside host
	OutsideV6 = netip.MustParseAddr("fd00:198:18:ff::2")
	ProbeV4   = netip.MustParseAddr("169.254.7.127")
	ProbeV6   = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// FixedClientPort is the first of the client ports tests bind on purpose
// (a tuple reused, a client coming back from the same port). It lies above
// ip_local_port_range's default 32768-60999, so no ephemeral connect made
// earlier in the same netns can hold it: a fixed port inside that range
// meets an earlier connection's TIME_WAIT now and then and bind fails with
// EADDRINUSE.
const FixedClientPort = 61000

// Node is one simulated node.
type Node struct {
	t          TB
	ID         string
	NodeNS     string // netns names (under /run/netns)
	OutsideNS  string
	CgroupRoot string // cgroup v2 directory owned by this node
	// PodsCgroup holds every pod's cgroup and the ztunnel stand-in's, as
	// kubelet's kubepods does; the node's own processes (the kubelet-like
	// app, agents) are beside it, under CgroupRoot.
	PodsCgroup string
	BPFFSDir   string // a private bpffs mount; pins go below it

	mu     sync.Mutex
	pods   []*Pod
	nextIP int
}

// New builds a node and registers its cleanup.
func New(t TB) *Node {
	t.Helper()
	if tb, ok := t.(testing.TB); ok {
		testenv.RequireRoot(tb)
	}
	n := &Node{t: t, ID: testenv.RunID(), nextIP: 10}
	n.NodeNS = "ae" + n.ID + "-node"
	n.OutsideNS = "ae" + n.ID + "-out"

	// Registered first, so it runs last: after every other cleanup, nothing
	// this node made may remain.
	t.Cleanup(func() { n.checkLeftovers() })

	cgRoot, err := hostfs.Cgroup2Root()
	if err != nil {
		t.Fatalf("find cgroup2: %v", err)
	}
	n.CgroupRoot = filepath.Join(cgRoot, "ae-test-"+n.ID)
	if err := os.Mkdir(n.CgroupRoot, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() { removeCgroupTree(t, n.CgroupRoot) })
	n.PodsCgroup = filepath.Join(n.CgroupRoot, "kubepods")
	if err := os.Mkdir(n.PodsCgroup, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}

	mnt := filepath.Join(t.TempDir(), "bpffs")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("bpf", mnt, "bpf", 0, "mode=0700"); err != nil {
		t.Fatalf("mount bpffs: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(mnt, unix.MNT_DETACH) })
	n.BPFFSDir = filepath.Join(mnt, "ambient-ebpf")

	n.addNetns(n.NodeNS)
	n.addNetns(n.OutsideNS)
	for _, ns := range []string{n.NodeNS, n.OutsideNS} {
		n.Sysctl(ns, "net/ipv6/conf/all/accept_dad", "0")
		n.Sysctl(ns, "net/ipv6/conf/default/accept_dad", "0")
		n.IP(ns, "link", "set", "lo", "up")
	}
	n.Sysctl(n.NodeNS, "net/ipv4/ip_forward", "1")
	n.Sysctl(n.NodeNS, "net/ipv6/conf/all/forwarding", "1")
	n.Sysctl(n.NodeNS, "net/ipv4/conf/all/rp_filter", "0")

	// node <-> outside
	n.IP(n.NodeNS, "link", "add", "out0", "type", "veth", "peer", "name", "eth0", "netns", n.OutsideNS)
	n.IP(n.NodeNS, "addr", "add", NodeV4.String()+"/24", "dev", "out0")
	n.IP(n.NodeNS, "addr", "add", NodeV6.String()+"/64", "dev", "out0", "nodad")
	n.IP(n.NodeNS, "link", "set", "out0", "up")
	n.IP(n.OutsideNS, "addr", "add", OutsideV4.String()+"/24", "dev", "eth0")
	n.IP(n.OutsideNS, "addr", "add", OutsideV6.String()+"/64", "dev", "eth0", "nodad")
	n.IP(n.OutsideNS, "link", "set", "eth0", "up")
	n.IP(n.OutsideNS, "route", "add", "default", "via", NodeV4.String())
	n.IP(n.OutsideNS, "-6", "route", "add", "default", "via", NodeV6.String())
	// The node owns the probe SNAT addresses, as kubelet's host does.
	n.IP(n.NodeNS, "addr", "add", ProbeV4.String()+"/32", "dev", "lo")
	n.IP(n.NodeNS, "addr", "add", ProbeV6.String()+"/128", "dev", "lo", "nodad")
	return n
}

func (n *Node) addNetns(name string) {
	n.t.Helper()
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		n.t.Fatalf("ip netns add %s: %v: %s", name, err, out)
	}
	n.t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", name).CombinedOutput(); err != nil {
			n.t.Errorf("ip netns del %s: %v: %s", name, err, out)
		}
	})
}

// NetnsPath returns the bind-mounted netns file of a named netns.
func NetnsPath(name string) string { return filepath.Join("/run/netns", name) }

// IP runs `ip -n ns args...` and fails the test on error.
func (n *Node) IP(ns string, args ...string) {
	n.t.Helper()
	if out, err := exec.Command("ip", append([]string{"-n", ns}, args...)...).CombinedOutput(); err != nil {
		n.t.Fatalf("ip -n %s %s: %v: %s", ns, strings.Join(args, " "), err, out)
	}
}

// Sysctl writes a /proc/sys/net value inside a netns. /proc/sys/net
// answers for the netns of the thread that opens it.
func (n *Node) Sysctl(ns, key, value string) {
	n.t.Helper()
	if err := InNetns(ns, func() error {
		return os.WriteFile(filepath.Join("/proc/sys", key), []byte(value), 0o644)
	}); err != nil {
		n.t.Fatalf("sysctl %s=%s in %s: %v", key, value, ns, err)
	}
}

// InNetns runs fn on a thread inside the named netns.
func InNetns(ns string, fn func() error) error {
	f, err := os.Open(NetnsPath(ns))
	if err != nil {
		return err
	}
	defer f.Close()
	s, err := sockutil.EnterNetns(f)
	if err != nil {
		return err
	}
	defer s.Close()
	return s.Do(fn)
}

// Pod is a simulated pod: a netns with eth0, addresses, and a cgroup.
type Pod struct {
	Name, Namespace, UID string
	NS                   string // netns name
	V4, V6               netip.Addr
	HostVeth             string
	Cgroup               string
}

// NetnsPath is the pod's netns file.
func (p *Pod) NetnsPath() string { return NetnsPath(p.NS) }

// IPs returns the pod's addresses.
func (p *Pod) IPs() []netip.Addr { return []netip.Addr{p.V4, p.V6} }

// AddPod creates a dual-stack pod with fresh addresses.
func (n *Node) AddPod(name string) *Pod {
	n.t.Helper()
	n.mu.Lock()
	idx := n.nextIP
	n.mu.Unlock()
	return n.AddPodWithAddrs(name, netip.AddrFrom4([4]byte{198, 18, byte(idx >> 8), byte(idx)}),
		netip.MustParseAddr(fmt.Sprintf("fd00:198:18:1::%x", idx)))
}

// AddPodWithAddrs creates a dual-stack pod with the given addresses (which
// may have belonged to a pod that is gone: IP reuse).
func (n *Node) AddPodWithAddrs(name string, v4, v6 netip.Addr) *Pod {
	n.t.Helper()
	n.mu.Lock()
	idx := n.nextIP
	n.mu.Unlock()
	return n.AddPodWith(name, "default", fmt.Sprintf("%s-0000-4000-8000-%012d", n.ID, idx), v4, v6)
}

// AddPodWith creates a dual-stack pod with every identity given (for pods
// that also exist in a Kubernetes API server).
func (n *Node) AddPodWith(name, namespace, uid string, v4, v6 netip.Addr) *Pod {
	n.t.Helper()
	n.mu.Lock()
	idx := n.nextIP
	n.nextIP++
	n.mu.Unlock()
	p := n.AddBarePod(name, namespace, uid)
	p.V4, p.V6 = v4, v6
	p.HostVeth = fmt.Sprintf("veth%s%d", n.ID[:4], idx)
	if p.V4 == GatewayV4 {
		n.t.Fatal("pod address collides with the gateway")
	}
	n.IP(n.NodeNS, "link", "add", p.HostVeth, "type", "veth", "peer", "name", "eth0", "netns", p.NS)
	n.IP(n.NodeNS, "addr", "add", GatewayV4.String()+"/32", "dev", p.HostVeth)
	n.IP(n.NodeNS, "addr", "add", GatewayV6.String()+"/128", "dev", p.HostVeth, "nodad")
	n.IP(n.NodeNS, "link", "set", p.HostVeth, "up")
	n.IP(n.NodeNS, "route", "add", p.V4.String()+"/32", "dev", p.HostVeth)
	n.IP(n.NodeNS, "-6", "route", "add", p.V6.String()+"/128", "dev", p.HostVeth)
	n.IP(p.NS, "addr", "add", p.V4.String()+"/32", "dev", "eth0")
	n.IP(p.NS, "addr", "add", p.V6.String()+"/128", "dev", "eth0", "nodad")
	n.IP(p.NS, "link", "set", "eth0", "up")
	n.IP(p.NS, "route", "add", GatewayV4.String()+"/32", "dev", "eth0")
	n.IP(p.NS, "route", "add", "default", "via", GatewayV4.String())
	n.IP(p.NS, "-6", "route", "add", GatewayV6.String()+"/128", "dev", "eth0")
	n.IP(p.NS, "-6", "route", "add", "default", "via", GatewayV6.String())
	return p
}

// AddBarePod creates a pod's netns (lo up, no interfaces: a CNI plugin
// adds them) and its cgroup, named pod<uid> as kubelet's cgroupfs driver
// names it, so /proc scans find the pod's processes.
func (n *Node) AddBarePod(name, namespace, uid string) *Pod {
	n.t.Helper()
	p := &Pod{Name: name, Namespace: namespace, UID: uid, NS: "ae" + n.ID + "-" + name,
		Cgroup: filepath.Join(n.PodsCgroup, "pod"+uid)}
	n.addNetns(p.NS)
	n.Sysctl(p.NS, "net/ipv6/conf/all/accept_dad", "0")
	n.Sysctl(p.NS, "net/ipv6/conf/default/accept_dad", "0")
	n.IP(p.NS, "link", "set", "lo", "up")
	if err := os.Mkdir(p.Cgroup, 0o755); err != nil {
		n.t.Fatalf("create pod cgroup: %v", err)
	}
	n.mu.Lock()
	n.pods = append(n.pods, p)
	n.mu.Unlock()
	return p
}

func (n *Node) checkLeftovers() {
	if entries, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), "ae"+n.ID) {
				n.t.Errorf("netns %s left behind", e.Name())
			}
		}
	}
	if _, err := os.Stat(n.CgroupRoot); err == nil {
		n.t.Errorf("cgroup %s left behind", n.CgroupRoot)
	}
	if out, err := exec.Command("ip", "-o", "link", "show").Output(); err == nil && strings.Contains(string(out), "veth"+n.ID[:4]) {
		n.t.Errorf("veth of node %s left in the root netns", n.ID)
	}
	if ok, _ := hostfs.IsBPFFS(filepath.Dir(n.BPFFSDir)); ok {
		n.t.Errorf("bpffs %s still mounted", filepath.Dir(n.BPFFSDir))
	}
}

// DeletePodNetwork removes the pod's veth (and with it the node's route to
// its addresses), as when a pod is gone before anyone removed it from the
// mesh. The pod's netns stays for late cleanup.
func (n *Node) DeletePodNetwork(p *Pod) {
	n.t.Helper()
	n.IP(n.NodeNS, "link", "del", p.HostVeth)
}

// VM is a host behind a pod's virtual interface (a VM's tap, say).
type VM struct {
	NS    string // netns name
	Iface string // the interface's name inside the pod
	Addr  netip.Addr
	Addr6 netip.Addr
}

// AddVirtualInterface gives the pod a virtual interface leading to a VM
// host of its own; the pod routes for it.
func (n *Node) AddVirtualInterface(p *Pod, iface string) *VM {
	n.t.Helper()
	v := &VM{NS: p.NS + "-vm", Iface: iface, Addr: netip.MustParseAddr("198.18.200.2"), Addr6: netip.MustParseAddr("fd00:198:18:200::2")}
	n.addNetns(v.NS)
	n.Sysctl(v.NS, "net/ipv6/conf/all/accept_dad", "0")
	n.Sysctl(v.NS, "net/ipv6/conf/default/accept_dad", "0")
	n.IP(v.NS, "link", "set", "lo", "up")
	n.IP(p.NS, "link", "add", iface, "type", "veth", "peer", "name", "eth0", "netns", v.NS)
	n.IP(p.NS, "addr", "add", "198.18.200.1/24", "dev", iface)
	n.IP(p.NS, "link", "set", iface, "up")
	n.IP(v.NS, "addr", "add", v.Addr.String()+"/24", "dev", "eth0")
	n.IP(v.NS, "link", "set", "eth0", "up")
	n.IP(v.NS, "route", "add", "default", "via", "198.18.200.1")
	n.IP(p.NS, "addr", "add", "fd00:198:18:200::1/64", "dev", iface, "nodad")
	n.IP(v.NS, "addr", "add", v.Addr6.String()+"/64", "dev", "eth0", "nodad")
	n.IP(v.NS, "-6", "route", "add", "default", "via", "fd00:198:18:200::1")
	n.Sysctl(p.NS, "net/ipv4/ip_forward", "1")
	n.Sysctl(p.NS, "net/ipv6/conf/all/forwarding", "1")
	return v
}

// removeCgroupTree removes a cgroup subtree this test made, ending the
// processes still in it (they are all this test's own helpers).
func removeCgroupTree(t TB, root string) {
	var dirs []string
	_ = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		if b, err := os.ReadFile(filepath.Join(dirs[i], "cgroup.procs")); err == nil && len(strings.TrimSpace(string(b))) > 0 {
			_ = os.WriteFile(filepath.Join(dirs[i], "cgroup.kill"), []byte("1"), 0o644)
		}
		for attempt := 0; ; attempt++ {
			err := unix.Rmdir(dirs[i])
			if err == nil || os.IsNotExist(err) {
				break
			}
			if attempt > 200 {
				t.Errorf("remove cgroup %s: %v", dirs[i], err)
				break
			}
			sleepShort()
		}
	}
}
