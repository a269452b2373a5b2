// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package node runs a real Kubernetes node's runtime for tests: Debian's
// containerd and runc, started with a config, root, state dir, socket, CNI
// directories, cgroup subtree, bpffs and node netns of their own under one
// per-run directory, and driven over CRI. Images are built offline with
// go-containerregistry and imported; the agent runs from the project's
// image with the chart's privileges (chart.go). Everything a Node made is
// removed by t.Cleanup, even on failure.
package node

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testenv"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// Addresses of the node (RFC 2544 benchmarking space): the primary CNI
// (ptp + host-local) gives pods addresses from PodSubnet.
var (
	PodSubnet = netip.MustParsePrefix("198.18.0.0/24")
	ProbeV4   = netip.MustParseAddr("169.254.7.127")
)

// Node is one containerd + runc node.
type Node struct {
	t  testing.TB
	ID string
	// Dir holds everything: config, root, state, socket, logs, volumes.
	Dir string
	// Netns is the node's network namespace (a bind-mounted nsfs file):
	// containerd, the agent and host-network pods run there.
	Netns string
	// CgroupParent is the cgroup path of every sandbox, relative to each
	// hierarchy's root; Cgroup2 is its cgroup v2 directory.
	CgroupParent, Cgroup2 string
	BPFFS                 string // a bpffs mount, shared to containers
	CNIBin, CNIConf       string
	// NetnsDir is where the runtime bind-mounts pod netns (a shared mount,
	// as /run/netns is on a node).
	NetnsDir string
	Socket   string

	Runtime cri.RuntimeServiceClient
	Images  cri.ImageServiceClient

	nsf        *sockutil.Netns // socket factory in the node netns
	conn       *grpc.ClientConn
	containerd *Proc
	mu         sync.Mutex
	mounts     []string // made by the test, unmounted in reverse
}

// Config is what New needs from the machine.
type Config struct {
	// CNIPlugins holds ptp, host-local and loopback (make cni-plugins).
	CNIPlugins string
	// Images are OCI archives to import before the runtime serves pods.
	Images []string
}

// New starts a node: the per-run directory and kernel objects, the primary
// CNI's configuration, containerd (ready to serve CRI), and imports the
// images. It fails the test when containerd or runc is not installed.
func New(t testing.TB, cfg Config) *Node {
	t.Helper()
	testenv.RequireRoot(t)
	for _, bin := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr"} {
		if _, err := exec.LookPath(bin); err != nil {
			testenv.SkipOrFail(t, "%s not installed (make deps installs containerd and runc): %v", bin, err)
		}
	}
	n := &Node{t: t, ID: testenv.RunID()}
	dir, err := os.MkdirTemp("", "hn-"+n.ID+"-")
	if err != nil {
		t.Fatal(err)
	}
	n.Dir = dir
	t.Cleanup(n.removeDir)
	n.mkdirs("netns", "state", "root", "cni/bin", "cni/net.d", "logs", "volumes")

	// The node netns.
	n.Netns = filepath.Join(dir, "netns", "node")
	if err := newNetns(n.Netns); err != nil {
		t.Fatalf("create node netns: %v", err)
	}
	n.mounts = append(n.mounts, n.Netns)
	f, err := os.Open(n.Netns)
	if err != nil {
		t.Fatal(err)
	}
	n.nsf, err = sockutil.EnterNetns(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.nsf.Close)
	n.InNode("ip", "link", "set", "lo", "up")
	n.InNode("ip", "addr", "add", ProbeV4.String()+"/32", "dev", "lo")
	if err := n.nsf.Do(func() error {
		for k, v := range map[string]string{"net/ipv4/ip_forward": "1", "net/ipv4/conf/all/rp_filter": "0"} {
			if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatalf("node sysctls: %v", err)
	}

	// The cgroup subtree: sandboxes go below it in every hierarchy; the
	// agent's socket hooks attach to its cgroup v2 directory.
	n.CgroupParent = "/hn-" + n.ID
	cg2, err := hostfs.Cgroup2Root()
	if err != nil {
		t.Fatalf("find cgroup2: %v", err)
	}
	n.Cgroup2 = filepath.Join(cg2, n.CgroupParent)
	if err := os.Mkdir(n.Cgroup2, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.removeCgroups)

	// bpffs and the netns directory, both shared so that mounts made on
	// the host after a container started reach it (HostToContainer).
	n.BPFFS = filepath.Join(dir, "bpffs")
	n.NetnsDir = filepath.Join(dir, "state", "io.containerd.grpc.v1.cri", "netns")
	n.mkdirs("bpffs", "state/io.containerd.grpc.v1.cri/netns")
	if err := n.mount("bpf", n.BPFFS, "bpf", 0, "mode=0700"); err != nil {
		t.Fatal(err)
	}
	if err := n.mount(n.NetnsDir, n.NetnsDir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{n.BPFFS, n.NetnsDir} {
		if err := unix.Mount("", m, "", unix.MS_SHARED, ""); err != nil {
			t.Fatalf("make %s shared: %v", m, err)
		}
	}

	// The primary CNI.
	n.CNIBin, n.CNIConf = filepath.Join(dir, "cni/bin"), filepath.Join(dir, "cni/net.d")
	for _, p := range []string{"ptp", "host-local", "loopback"} {
		b, err := os.ReadFile(filepath.Join(cfg.CNIPlugins, p))
		if err != nil {
			t.Fatalf("CNI plugin %s (make cni-plugins): %v", p, err)
		}
		if err := os.WriteFile(filepath.Join(n.CNIBin, p), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(n.CNIConf, "10-ptp.conflist"), []byte(fmt.Sprintf(primaryCNI, PodSubnet, filepath.Join(dir, "ipam"))), 0o644); err != nil {
		t.Fatal(err)
	}

	// containerd 1.6's shim puts its sockets in /run/containerd/s whatever
	// the config says; the directory is removed after the runtime stops
	// if this node made it.
	if _, err := os.Stat(shimSocketDir); errors.Is(err, os.ErrNotExist) {
		t.Cleanup(func() { _ = os.Remove(shimSocketDir); _ = os.Remove(filepath.Dir(shimSocketDir)) })
	}
	n.startContainerd()
	for _, img := range cfg.Images {
		n.ImportImage(img)
	}
	return n
}

const shimSocketDir = "/run/containerd/s"

// primaryCNI is the node's network: ptp with host-local IPAM, as the
// simulated node's pods are wired (a /32 route per pod on the node).
const primaryCNI = `{
  "cniVersion": "1.0.0",
  "name": "podnet",
  "plugins": [
    {"type": "ptp", "ipMasq": false, "mtu": 1500,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "dataDir": %q, "routes": [{"dst": "0.0.0.0/0"}]}}
  ]
}
`

func (n *Node) mkdirs(dirs ...string) {
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			n.t.Fatal(err)
		}
	}
}

func (n *Node) mount(src, dst, fstype string, flags uintptr, data string) error {
	if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", src, dst, err)
	}
	n.mu.Lock()
	n.mounts = append(n.mounts, dst)
	n.mu.Unlock()
	return nil
}

// newNetns creates a network namespace and bind-mounts it at path, on a
// thread that is never unlocked (it exits with its goroutine).
func newNetns(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(src, path, "", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind %s: %w", path, err)
			return
		}
		errc <- nil
	}()
	return <-errc
}

// InNode runs a command in the node netns and fails the test on error.
func (n *Node) InNode(argv ...string) string {
	n.t.Helper()
	out, err := exec.Command("nsenter", append([]string{"--net=" + n.Netns, "--"}, argv...)...).CombinedOutput()
	if err != nil {
		n.t.Fatalf("in node netns: %s: %v: %s", strings.Join(argv, " "), err, out)
	}
	return string(out)
}

// NodeSockets makes sockets inside the node netns.
func (n *Node) NodeSockets() *sockutil.Netns { return n.nsf }

// Forward listens on 127.0.0.1 in the node netns and relays each
// connection to target (an address of the test's own netns): how the node
// reaches the test's kube-apiserver. It returns the node-side address.
func (n *Node) Forward(target string) netip.AddrPort {
	n.t.Helper()
	l, err := n.nsf.Listen(netip.MustParseAddrPort("127.0.0.1:0"), sockutil.Opts{})
	if err != nil {
		n.t.Fatalf("listen in the node netns: %v", err)
	}
	n.t.Cleanup(func() { l.Close() })
	sockutil.Forward(l, target)
	return sockutil.AddrPort(l.Addr())
}

// containerdConfig is the runtime's whole configuration: nothing of it
// refers to the machine's containerd, CNI or run directories.
const containerdConfig = `version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = %[5]q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[6]q
  netns_mounts_under_state_dir = true
  # The test runs where lowering oom_score_adj is refused (EACCES):
  # keep containers at containerd's own score or above.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[7]q
    conf_dir = %[8]q
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = %[9]q
        SystemdCgroup = false
`

func (n *Node) startContainerd() {
	n.t.Helper()
	// Shims outlive containerd: ended after it (cleanups run in reverse).
	n.t.Cleanup(n.killShims)
	n.StartContainerd()
}

// StartContainerd starts the node's containerd (again, after PowerOff or
// StopContainerd) and waits until it serves CRI.
func (n *Node) StartContainerd() {
	t := n.t
	t.Helper()
	n.Socket = filepath.Join(n.Dir, "containerd.sock")
	cfgPath := filepath.Join(n.Dir, "containerd.toml")
	cfg := fmt.Sprintf(containerdConfig, filepath.Join(n.Dir, "root"), filepath.Join(n.Dir, "state"), n.Socket,
		filepath.Join(n.Dir, "containerd-ttrpc.sock"), filepath.Join(n.Dir, "opt"), PauseImage,
		n.CNIBin, n.CNIConf, filepath.Join(n.Dir, "runc"))
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	// In the node netns (pods' veth peers land there), in the test's
	// mount namespace (the runtime's mounts must be visible to the test).
	n.containerd = n.StartInNode("containerd", "", "containerd", "--config", cfgPath)
	// Before this containerd stops (cleanups run in reverse): the sandboxes
	// go through the runtime, their CNI DEL run.
	t.Cleanup(n.removeSandboxes)

	if n.conn != nil {
		n.conn.Close()
	}
	conn, err := grpc.NewClient("unix://"+n.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	n.conn = conn
	n.Runtime, n.Images = cri.NewRuntimeServiceClient(conn), cri.NewImageServiceClient(conn)
	var verr error
	testenv.Poll(60*time.Second, func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, verr = n.Runtime.Version(ctx, &cri.VersionRequest{})
		cancel()
		return verr == nil || n.containerd.Exited()
	})
	switch {
	case verr == nil:
	case n.containerd.Exited():
		t.Fatalf("containerd exited: %s", n.LogTail("containerd.log"))
	default:
		t.Fatalf("containerd not serving CRI: %v\n%s", verr, n.LogTail("containerd.log"))
	}
}

// LogTail returns the end of a log file in the node's directory.
func (n *Node) LogTail(name string) string {
	b, err := os.ReadFile(filepath.Join(n.Dir, name))
	if err != nil {
		return err.Error()
	}
	if len(b) > 4096 {
		b = b[len(b)-4096:]
	}
	return string(b)
}

// ImportImage loads an OCI archive into the runtime's image store (the
// CRI namespace), as `ctr images import` does on a node.
func (n *Node) ImportImage(archive string) {
	n.t.Helper()
	out, err := exec.Command("ctr", "--address", n.Socket, "--namespace", "k8s.io", "images", "import", archive).CombinedOutput()
	if err != nil {
		n.t.Fatalf("ctr images import %s: %v: %s", archive, err, out)
	}
}

// removeSandboxes removes every sandbox through CRI (their CNI DEL runs)
// before containerd stops.
func (n *Node) removeSandboxes() {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if n.Runtime != nil {
		if list, err := n.Runtime.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{}); err == nil {
			for _, sb := range list.Items {
				if _, err := n.Runtime.StopPodSandbox(ctx, &cri.StopPodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
					n.t.Errorf("cleanup: stop sandbox %s: %v", sb.Metadata.GetName(), err)
				}
				if _, err := n.Runtime.RemovePodSandbox(ctx, &cri.RemovePodSandboxRequest{PodSandboxId: sb.Id}); err != nil {
					n.t.Errorf("cleanup: remove sandbox %s: %v", sb.Metadata.GetName(), err)
				}
			}
		}
	}
	if n.conn != nil {
		n.conn.Close()
	}
}

// killShims ends any shim of this runtime left behind once it stopped.
func (n *Node) killShims() {
	for _, pid := range n.shims() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// shims returns the PIDs of containerd-shim processes serving this node's
// containerd (their command line names its socket).
func (n *Node) shims() []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if strings.HasSuffix(args[0], "containerd-shim-runc-v2") && strings.Contains(string(b), n.Socket) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// removeCgroups removes the node's subtree in every cgroup hierarchy,
// deepest first. The runtime has stopped and removed its sandboxes; a
// process still in the subtree (a container a failed cleanup left) is
// the node's and ended first.
func (n *Node) removeCgroups() {
	if err := n.killCgroupProcs(10 * time.Second); err != nil {
		n.t.Errorf("cleanup: %v", err)
	}
	if err := n.removeCgroupTree(true); err != nil {
		n.t.Errorf("cleanup: %v", err)
	}
}

// removeCgroupsBelow removes every cgroup below the node's cgroup parent
// in every hierarchy, and keeps the parents: a reboot's empty slate.
func (n *Node) removeCgroupsBelow() error { return n.removeCgroupTree(false) }

// removeCgroupTree removes the cgroups of the node's subtree, deepest
// first, retrying while the last processes are reaped; root says whether
// the node's cgroup parent goes too.
func (n *Node) removeCgroupTree(root bool) error {
	mounts, err := hostfs.Mounts()
	if err != nil {
		return err
	}
	var errs []error
	for _, m := range mounts {
		if m.FSType != "cgroup" && m.FSType != "cgroup2" {
			continue
		}
		top := filepath.Join(m.MountPoint, n.CgroupParent)
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() && (root || p != top) {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			var err error
			for range 100 {
				if err = unix.Rmdir(dirs[i]); err == nil || errors.Is(err, unix.ENOENT) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dirs[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

// removeDir unmounts everything below the node's directory (what the test
// mounted and what the runtime left, deepest first) and removes it.
func (n *Node) removeDir() {
	var below []string
	if f, err := os.Open("/proc/self/mountinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) > 4 && strings.HasPrefix(fields[4], n.Dir+"/") {
				below = append(below, fields[4])
			}
		}
		f.Close()
	}
	sort.Slice(below, func(i, j int) bool { return len(below[i]) > len(below[j]) })
	for _, m := range below {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			n.t.Errorf("cleanup: unmount %s: %v", m, err)
		}
	}
	if err := os.RemoveAll(n.Dir); err != nil {
		n.t.Errorf("cleanup: %v", err)
	}
}
