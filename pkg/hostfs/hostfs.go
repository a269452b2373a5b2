// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package hostfs finds the host filesystems the data path needs: the cgroup
// v2 hierarchy (wherever this node mounted it) and a bpffs for pins.
package hostfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
)

// ErrNotMounted is returned when no mount of the wanted type exists.
var ErrNotMounted = errors.New("not mounted")

// Mount is one mount of the calling process's mount table, reduced to what
// the data path and the node preflight use.
type Mount struct {
	MountPoint string
	FSType     string
}

// Mounts reads the calling process's mount table.
func Mounts() ([]Mount, error) {
	infos, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil, fmt.Errorf("read mounts: %w", err)
	}
	out := make([]Mount, len(infos))
	for i, m := range infos {
		out[i] = Mount{MountPoint: m.Mountpoint, FSType: m.FSType}
	}
	return out, nil
}

func firstOfType(fstype string) (string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter(fstype))
	if err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	if len(mounts) == 0 {
		return "", fmt.Errorf("%s: %w", fstype, ErrNotMounted)
	}
	return mounts[0].Mountpoint, nil
}

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy
// (/sys/fs/cgroup on most nodes, /sys/fs/cgroup/unified on hybrid ones).
func Cgroup2Root() (string, error) {
	return firstOfType("cgroup2")
}

// PodsCgroup is the cgroup kubelet puts every pod in, right below the
// cgroup v2 directory root: kubepods.slice (the systemd driver) or
// kubepods (cgroupfs); "" when neither is there.
func PodsCgroup(root string) string {
	for _, name := range []string{"kubepods.slice", "kubepods"} {
		if fi, err := os.Stat(filepath.Join(root, name)); err == nil && fi.IsDir() {
			return filepath.Join(root, name)
		}
	}
	return ""
}

// PodCgroup is the cgroup of the pod with uid below kubelet's pods cgroup
// pods, as kubelet names it: pod<uid> at the top or below the burstable
// and besteffort QoS cgroups (the cgroupfs driver), or
// kubepods[-<qos>]-pod<uid with _ for ->.slice (the systemd driver).
// Fails when there is none, naming where it looked.
func PodCgroup(pods, uid string) (string, error) {
	su := strings.ReplaceAll(uid, "-", "_")
	candidates := []string{
		filepath.Join(pods, "pod"+uid),
		filepath.Join(pods, "burstable", "pod"+uid),
		filepath.Join(pods, "besteffort", "pod"+uid),
		filepath.Join(pods, "kubepods-pod"+su+".slice"),
		filepath.Join(pods, "kubepods-burstable.slice", "kubepods-burstable-pod"+su+".slice"),
		filepath.Join(pods, "kubepods-besteffort.slice", "kubepods-besteffort-pod"+su+".slice"),
	}
	for _, c := range candidates {
		if fi, err := os.Stat(c); err == nil && fi.IsDir() {
			return c, nil
		}
	}
	return "", fmt.Errorf("no cgroup of pod uid %s below %s (kubelet's pod<uid> or kubepods-*pod<uid>.slice)", uid, pods)
}

// ProcessCgroup is the cgroup v2 directory of process pid, read from
// procRoot (the host's /proc): the cgroup of its pod when its path names
// one (kubelet's pod<uid> or kubepods-*pod<uid>.slice), found below pods,
// so that it resolves from inside a cgroup namespace too; otherwise its
// own directory below the cgroup v2 mount point mount.
func ProcessCgroup(procRoot string, pid int, mount, pods string) (string, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "cgroup"))
	if err != nil {
		return "", fmt.Errorf("cgroup of process %d: %w", pid, err)
	}
	path, ok := UnifiedCgroupPath(string(b))
	if !ok {
		return "", fmt.Errorf("cgroup of process %d: no cgroup v2 entry in %s/%d/cgroup", pid, procRoot, pid)
	}
	if uid, ok := PodUIDOfCgroup(path); ok {
		return PodCgroup(pods, uid)
	}
	if strings.HasPrefix(path, "/..") {
		return "", fmt.Errorf("cgroup of process %d: %s is outside this cgroup namespace and names no pod", pid, path)
	}
	return filepath.Join(mount, path), nil
}

// UnifiedCgroupPath is the cgroup v2 path of a /proc/<pid>/cgroup file's
// content: its "0::<path>" line.
func UnifiedCgroupPath(content string) (string, bool) {
	for line := range strings.Lines(content) {
		if path, ok := strings.CutPrefix(strings.TrimRight(line, "\n"), "0::"); ok && strings.HasPrefix(path, "/") {
			return filepath.Clean(path), true
		}
	}
	return "", false
}

// PodUIDOfCgroup is the pod UID a cgroup path names, the innermost
// component that is kubelet's pod cgroup: pod<uid> (cgroupfs) or
// kubepods[-<qos>]-pod<uid with _ for ->.slice (systemd).
func PodUIDOfCgroup(path string) (string, bool) {
	parts := strings.Split(path, "/")
	for i := len(parts) - 1; i >= 0; i-- {
		p := parts[i]
		if rest, ok := strings.CutSuffix(p, ".slice"); ok && strings.HasPrefix(p, "kubepods") {
			if _, uid, ok := strings.Cut(rest, "-pod"); ok && validPodUID(uid) {
				return strings.ReplaceAll(uid, "_", "-"), true
			}
			continue
		}
		if uid, ok := strings.CutPrefix(p, "pod"); ok && validPodUID(uid) {
			return uid, true
		}
	}
	return "", false
}

// validPodUID: a UID as kubelet puts it in a cgroup name (hex digits and
// dashes or underscores), never a path.
func validPodUID(s string) bool {
	if len(s) == 0 || len(s) > 63 {
		return false
	}
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f' || r >= 'A' && r <= 'F' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}
