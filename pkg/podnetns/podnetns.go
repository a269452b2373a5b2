// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package podnetns finds a pod's network namespace on this node without the
// container runtime: it scans /proc for a process whose cgroup path names
// the pod UID, and takes that process's netns (/proc/<pid>/ns/net). The agent
// uses it for the start-up snapshot (contract section 5) and to redirect
// running pods in place.
//
// The kubelet puts each pod in a cgroup named after its UID, whatever the
// runtime; the layouts recognised are
//
//	cgroup v2, systemd driver:  0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope
//	cgroup v2, CRI-O:           0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/crio-<id>.scope
//	cgroup v1/v2, cgroupfs:     4:memory:/kubepods/besteffort/pod<uid>/<container id>
//	guaranteed QoS:             .../kubepods-pod<uid_with_underscores>.slice/... or /kubepods/pod<uid>/...
//
// also when nested under another cgroup (kind nodes, kubelet.slice).
package podnetns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/fdlimit"
)

// ErrNotFound is returned when no process of the pod runs on this node.
var ErrNotFound = errors.New("no process of the pod found in /proc")

// NetNS names a pod's network namespace.
type NetNS struct {
	// Path is /proc/<pid>/ns/net under the proc root; opening it holds the
	// netns for as long as the file stays open.
	Path string
	// PID is the process it was found through.
	PID int
	// Dev and Inode identify the netns (nsfs) across processes and paths.
	Dev, Inode uint64
}

// DefaultNetnsDir is where container runtimes name pod network namespaces.
const DefaultNetnsDir = "/run/netns"

// Finder scans a proc file system (and, for All, the named netns).
type Finder struct {
	// ProcRoot is the proc mount, "/proc" on a node; the agent's DaemonSet
	// usually mounts the host's at another path.
	ProcRoot string
	// NetnsDir holds named network namespaces; "" means DefaultNetnsDir.
	NetnsDir string
}

// New returns a Finder over procRoot ("" means /proc).
func New(procRoot string) *Finder {
	if procRoot == "" {
		procRoot = "/proc"
	}
	return &Finder{ProcRoot: procRoot}
}

// All returns every network namespace of the node once, by (device,
// inode): the named ones under NetnsDir first (where container runtimes
// put pod netns, so a pod's netns is found by the path its CNI ADD named),
// then each process's under the proc root, lowest PID first.
func (f *Finder) All() []NetNS {
	dir := f.NetnsDir
	if dir == "" {
		dir = DefaultNetnsDir
	}
	named, _ := filepath.Glob(filepath.Join(dir, "*"))
	procs, _ := filepath.Glob(filepath.Join(f.ProcRoot, "[0-9]*", "ns", "net"))
	pid := func(path string) int {
		n, _ := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(path))))
		return n
	}
	slices.SortFunc(procs, func(a, b string) int { return pid(a) - pid(b) })
	var out []NetNS
	seen := map[[2]uint64]bool{}
	for i, path := range append(named, procs...) {
		dev, ino, err := statNetNS(path)
		if err != nil || seen[[2]uint64{dev, ino}] {
			continue // gone since, not a netns, or seen under another path
		}
		seen[[2]uint64{dev, ino}] = true
		ns := NetNS{Path: path, Dev: dev, Inode: ino}
		if i >= len(named) {
			ns.PID = pid(path)
		}
		out = append(out, ns)
	}
	return out
}

// Find returns the network namespace of the pod with this UID (a Scan:
// for several pods, Scan once).
func (f *Finder) Find(ctx context.Context, uid types.UID) (NetNS, error) {
	found, err := f.Scan(ctx)
	if err != nil {
		return NetNS{}, err
	}
	ns, ok := found[uid]
	if !ok {
		return NetNS{}, fmt.Errorf("pod uid %s: %w", uid, ErrNotFound)
	}
	return ns, nil
}

// Scan reads the proc root once and returns, by pod UID, the netns of
// every pod that has a process on this node. Of several processes of a pod
// the lowest PID wins (usually the sandbox's pause process). Processes that
// exit during the scan are passed over. A node runs thousands of
// processes: the scan stops with ctx's error as soon as ctx ends.
func (f *Finder) Scan(ctx context.Context) (map[types.UID]NetNS, error) {
	entries, err := os.ReadDir(f.ProcRoot)
	if err != nil {
		return nil, fdlimit.Annotate(fmt.Errorf("scan %s: %w", f.ProcRoot, err))
	}
	var pids []int
	for _, e := range entries {
		if pid, err := strconv.Atoi(e.Name()); err == nil && pid > 0 {
			pids = append(pids, pid)
		}
	}
	slices.Sort(pids)
	found := map[types.UID]NetNS{}
	for _, pid := range pids {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("scan %s: %w", f.ProcRoot, err)
		}
		dir := filepath.Join(f.ProcRoot, strconv.Itoa(pid))
		uid, ok, err := readPodUID(filepath.Join(dir, "cgroup"))
		if errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) {
			// Not a process that exited: every later one would be
			// passed over too, and its pod taken for gone.
			return nil, fdlimit.Annotate(fmt.Errorf("scan %s: %w", f.ProcRoot, err))
		}
		if err != nil || !ok {
			continue
		}
		if _, done := found[uid]; done {
			continue
		}
		path := filepath.Join(dir, "ns", "net")
		dev, ino, err := statNetNS(path)
		if err != nil {
			continue // exited since, or a kernel thread
		}
		found[uid] = NetNS{Path: path, PID: pid, Dev: dev, Inode: ino}
	}
	return found, nil
}

// Current reports whether ns, as an earlier Scan found it for the pod
// with this UID, still is: its process is still the pod's and still in
// that netns. Two reads instead of a scan, so a scan's result can serve
// many pods; false when the process exited (or its PID was reused).
func (f *Finder) Current(uid types.UID, ns NetNS) bool {
	if ns.PID <= 0 {
		return false
	}
	got, ok, err := readPodUID(filepath.Join(f.ProcRoot, strconv.Itoa(ns.PID), "cgroup"))
	if err != nil || !ok || got != uid {
		return false
	}
	dev, ino, err := statNetNS(ns.Path)
	return err == nil && dev == ns.Dev && ino == ns.Inode
}

// Same reports whether the paths a and b name the same network namespace,
// by path or by the (device, inode) of their nsfs files; known is false when
// the paths differ and either cannot be stat'ed (its namespace or process
// is gone already).
func (f *Finder) Same(a, b string) (same, known bool) {
	if a == b {
		return true, true
	}
	devA, inoA, err := statNetNS(a)
	if err != nil {
		return false, false
	}
	devB, inoB, err := statNetNS(b)
	if err != nil {
		return false, false
	}
	return devA == devB && inoA == inoB, true
}

func readPodUID(path string) (types.UID, bool, error) {
	fh, err := os.Open(path)
	if err != nil {
		return "", false, err
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if uid, ok := PodUIDFromCgroupLine(sc.Text()); ok {
			return uid, true, nil
		}
	}
	return "", false, sc.Err()
}

// podSegment matches a cgroup path element naming a pod: "pod<uid>" or
// "<prefix>-pod<uid_with_underscores>.slice".
var podSegment = regexp.MustCompile(`^(?:[a-z0-9_.-]*-)?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?:\.slice)?$`)

// PodUIDFromCgroupLine returns the pod UID named by one line of
// /proc/<pid>/cgroup ("hierarchy-ID:controllers:path"), if any.
func PodUIDFromCgroupLine(line string) (types.UID, bool) {
	parts := strings.SplitN(line, ":", 3)
	if len(parts) != 3 {
		return "", false
	}
	segments := strings.Split(parts[2], "/")
	// The innermost match is the pod; a pod segment is never nested in
	// another, but a node's own cgroup could contain a "pod" word.
	for i := len(segments) - 1; i >= 0; i-- {
		if m := podSegment.FindStringSubmatch(segments[i]); m != nil {
			return types.UID(strings.ReplaceAll(m[1], "_", "-")), true
		}
	}
	return "", false
}
