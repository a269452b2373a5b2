// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/hostfs"
)

// NodeIP is the node's own address (an interface in the node netns),
// which kubelet reports as the node's and the pods' host IP.
var NodeIP = netip.MustParseAddr("198.19.0.1")

// Proc is a process the node started; it is ended by PID at cleanup.
type Proc struct {
	cmd  *exec.Cmd
	done chan struct{}
	Log  string // stdout and stderr
}

// Exited reports whether the process has ended.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// StartInNode runs argv in the node netns, in the cgroup v2 directory
// cgroup (made if missing; "" for the test's own), logging to <name>.log in
// the node's directory. It ends at cleanup: SIGTERM, SIGKILL after 20 s.
func (n *Node) StartInNode(name, cgroup string, argv ...string) *Proc {
	n.t.Helper()
	attr := &syscall.SysProcAttr{Setpgid: true}
	if cgroup != "" {
		if err := os.MkdirAll(cgroup, 0o755); err != nil {
			n.t.Fatal(err)
		}
		fd, err := syscall.Open(cgroup, syscall.O_DIRECTORY|syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			n.t.Fatalf("open cgroup %s: %v", cgroup, err)
		}
		defer syscall.Close(fd)
		attr.UseCgroupFD, attr.CgroupFD = true, fd
	}
	p := &Proc{done: make(chan struct{}), Log: filepath.Join(n.Dir, name+".log")}
	// Appended to: a process started again after a reboot keeps one log.
	logf, err := os.OpenFile(p.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		n.t.Fatal(err)
	}
	p.cmd = exec.Command("nsenter", append([]string{"--net=" + n.Netns, "--"}, argv...)...)
	p.cmd.Stdout, p.cmd.Stderr = logf, logf
	p.cmd.SysProcAttr = attr
	if err := p.cmd.Start(); err != nil {
		logf.Close()
		n.t.Fatalf("start %s: %v", name, err)
	}
	go func() { _ = p.cmd.Wait(); logf.Close(); close(p.done) }()
	n.t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(20 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// kubeletConfig is the KubeletConfiguration of the test node: its root,
// cgroups, logs and runtime are the node's; cgroup v1 is allowed (this
// machine's layout is v1 controllers with cgroup2 at .../unified).
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: %[1]q
staticPodPath: %[2]q
podLogsDir: %[3]q
containerRuntimeEndpoint: %[4]q
address: 127.0.0.1
port: 10250
healthzPort: 10248
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
failSwapOn: false
resolvConf: ""
registerNode: true
syncFrequency: 5s
fileCheckFrequency: 5s
nodeStatusUpdateFrequency: 5s
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "1Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
localStorageCapacityIsolation: false
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization:
  mode: AlwaysAllow
`

// Kubelet is a kubelet for this node.
type Kubelet struct {
	*Proc
	PodLogs string
	start   func() *Proc
}

// Start runs kubelet again, with its configuration and root as before
// (after Node.PowerOff).
func (k *Kubelet) Start() { k.Proc = k.start() }

// StartKubelet runs kubelet (bin) in the node netns and in the node's
// cgroup v2 subtree (its probes' sockets are seen by the agent's socket
// hooks there, as on a node), registering nodeName with the API server at
// api (as the node reaches it) with token.
func (n *Node) StartKubelet(bin, nodeName string, api netip.AddrPort, token string) *Kubelet {
	n.t.Helper()
	// No dummy driver here: a veth pair with both ends in the node netns.
	n.InNode("ip", "link", "add", "node0", "type", "veth", "peer", "name", "node0p")
	n.InNode("ip", "addr", "add", NodeIP.String()+"/24", "dev", "node0")
	n.InNode("ip", "link", "set", "node0p", "up")
	n.InNode("ip", "link", "set", "node0", "up")
	// kubelet requires its cgroup root in every hierarchy.
	mounts, err := hostfs.Mounts()
	if err != nil {
		n.t.Fatal(err)
	}
	for _, m := range mounts {
		if m.FSType == "cgroup" || m.FSType == "cgroup2" {
			if err := os.MkdirAll(filepath.Join(m.MountPoint, n.CgroupParent), 0o755); err != nil {
				n.t.Fatal(err)
			}
		}
	}
	dir := filepath.Join(n.Dir, "kubelet")
	k := &Kubelet{PodLogs: filepath.Join(dir, "pod-logs")}
	for _, d := range []string{"root", "certs", "manifests", "pod-logs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			n.t.Fatal(err)
		}
	}
	cfg := fmt.Sprintf(kubeletConfig, n.CgroupParent, filepath.Join(dir, "manifests"), k.PodLogs, "unix://"+n.Socket)
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: "https://%s", insecure-skip-tls-verify: true}}]
users: [{name: kubelet, user: {token: %q}}]
contexts: [{name: test, context: {cluster: test, user: kubelet}}]
current-context: test
`, api, token)
	for f, b := range map[string]string{"config.yaml": cfg, "kubeconfig": kubeconfig} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(b), 0o600); err != nil {
			n.t.Fatal(err)
		}
	}
	k.start = func() *Proc {
		return n.StartInNode("kubelet", filepath.Join(n.Cgroup2, "kubelet"), bin,
			"--config="+filepath.Join(dir, "config.yaml"),
			"--kubeconfig="+filepath.Join(dir, "kubeconfig"),
			"--root-dir="+filepath.Join(dir, "root"),
			"--cert-dir="+filepath.Join(dir, "certs"),
			"--hostname-override="+nodeName,
			"--node-ip="+NodeIP.String(),
			"--v=1")
	}
	k.Start()
	return k
}

// PodLog returns the lines a container of a kubelet pod wrote.
func (k *Kubelet) PodLog(namespace, name, uid, container string) []string {
	b, _ := os.ReadFile(filepath.Join(k.PodLogs, namespace+"_"+name+"_"+uid, container, "0.log"))
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if parts := strings.SplitN(l, " ", 4); len(parts) == 4 {
			out = append(out, parts[3])
		}
	}
	return out
}

// LogTail returns the end of kubelet's log.
func (k *Kubelet) LogTail() string {
	b, _ := os.ReadFile(k.Log)
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}
