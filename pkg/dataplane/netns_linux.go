// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/nsexec"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"

	"golang.org/x/sys/unix"
)

// queryNetnsCookie is currentNetnsCookie for kernels without
// SO_NETNS_COOKIE (before 5.14): a socket marked in ae_nsq is bound, and
// the ae_netns_query hook on the agent's cgroup writes the netns cookie
// into the mark. Being a BPF call, it also makes older kernels (before
// 5.12) give the netns its cookie.
func (d *Dataplane) queryNetnsCookie() (uint64, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	key := int32(fd)
	if err := d.sock.AeNsq.Put(key, uint64(0)); err != nil {
		return 0, fmt.Errorf("mark netns query socket in ae_nsq: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrInet4{}); err != nil {
		return 0, fmt.Errorf("bind netns query socket: %w", err)
	}
	var cookie uint64
	if err := d.sock.AeNsq.Lookup(key, &cookie); err != nil {
		return 0, fmt.Errorf("read ae_nsq: %w", err)
	}
	if cookie == 0 {
		return 0, fmt.Errorf("netns cookie query unanswered: the agent's cgroup is not below the ae_netns_query hook")
	}
	return cookie, nil
}

// ownCgroup returns the cgroup v2 directory of the calling process.
func ownCgroup() (string, error) {
	root, err := hostfs.Cgroup2Root()
	if err != nil {
		return "", err
	}
	data, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", fmt.Errorf("read own cgroup: %w", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rel, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(root, rel), nil
		}
	}
	return root, nil
}

// netnsFinder returns a lookup from netns cookie to a path of that netns,
// for adopting pods whose netns path an earlier agent knew. The node's
// netns come from pkg/podnetns (named netns first, then every process's
// under Config.ProcRoot); the scan runs once, on first use.
func (d *Dataplane) netnsFinder(pods int) func(cookie uint64) string {
	if pods == 0 {
		return func(uint64) string { return "" }
	}
	byCookie := sync.OnceValue(func() map[uint64]string {
		found := map[uint64]string{}
		for _, ns := range podnetns.New(d.cfg.ProcRoot).All() {
			var cookie uint64
			if nsexec.Do(ns.Path, func() (err error) { cookie, err = d.netnsCookie(); return err }) == nil {
				if _, dup := found[cookie]; !dup {
					found[cookie] = ns.Path
				}
			}
		}
		return found
	})
	return func(cookie uint64) string { return byCookie()[cookie] }
}

// netnsID identifies a network namespace: the device and inode of its
// nsfs file, the same for every path (named netns bind mount,
// /proc/<pid>/ns/net) that names it.
type netnsID struct{ dev, ino uint64 }

func statNetns(path string) (netnsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return netnsID{}, fmt.Errorf("stat netns %s: %w", path, err)
	}
	return netnsID{dev: st.Dev, ino: st.Ino}, nil
}

// nodeNetnsIDs are the namespaces no pod may name: the node's
// (Config.NodeNetns) and that of the node's init process (1 under
// Config.ProcRoot, the host's /proc in the agent's pod). Enrolling either
// would capture the node's own TCP (kubelet, the API server's clients,
// ssh) and, since a veth's node side then equals its peer, pass the host
// interface check. Not /proc/self/ns/net: that is the main thread's, which
// a process switching threads into pod netns does not keep.
func nodeNetnsIDs(cfg Config) ([]netnsID, error) {
	node, err := statNetns(cfg.NodeNetns)
	if err != nil {
		return nil, fmt.Errorf("node netns: %w", err)
	}
	ids := []netnsID{node}
	// Best effort: a procfs without PID 1's netns to read (another pid
	// namespace, no ptrace access) leaves the node's alone to compare.
	if init, err := statNetns(filepath.Join(cfg.ProcRoot, "1/ns/net")); err == nil && init != node {
		ids = append(ids, init)
	}
	return ids, nil
}

// refuseNodeNetns fails when path names the node's own network namespace
// (nodeNetnsIDs): a CNI ADD, a pod file or a pod's status can carry any
// path, and only a pod's own netns may be enrolled.
func (d *Dataplane) refuseNodeNetns(path string) error {
	id, err := statNetns(path)
	if err != nil {
		return err
	}
	if slices.Contains(d.nodeNetns, id) {
		return fmt.Errorf("netns %s is the node's own network namespace, not a pod's: refusing to enrol it", path)
	}
	return nil
}
