// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	current "github.com/containernetworking/cni/pkg/types/100"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/test/kubeapi"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
)

// PrimaryPlugins are the reference plugins the primary network uses, built
// by `make cni-plugins` into CNI_PLUGINS_DIR.
var PrimaryPlugins = []string{"ptp", "host-local", "loopback"}

// Runtime is a container runtime's side of CNI on a simulated node, as
// containerd does it through libcni: it creates each sandbox's netns under
// a netns folder of its own (NetnsDir, the node's /var/run/netns), reads
// the first conflist of the host's CNI config folder at each call (where a
// node agent's installer chained its plugin) and runs ADD and DEL on a
// thread in the node netns, so every plugin runs there.
type Runtime struct {
	t    simnode.TB
	Node *simnode.Node
	// BinDir and ConfDir are the host's /opt/cni/bin and /etc/cni/net.d.
	BinDir, ConfDir string
	// NetnsDir is a shared mount: a netns bound in it after a node agent
	// started in a mount namespace of its own (HostToContainer) still
	// appears there.
	NetnsDir string
	cni      *libcni.CNIConfig
	node     *sockutil.Netns
}

// The primary network's pod subnets: every node's pods get the same
// addresses, so two nodes' results compare.
const (
	PodSubnet4 = "198.18.100.0/24"
	PodSubnet6 = "fd00:198:18:100::/64"
)

// NewRuntime writes the primary network into the host's CNI folders
// binDir and confDir (made in a directory of t's when empty): ptp +
// host-local from pluginsDir on PodSubnet4 and PodSubnet6
// (10-primary.conflist), as the cluster's CNI installs it.
func NewRuntime(t simnode.TB, n *simnode.Node, binDir, confDir, pluginsDir string) *Runtime {
	t.Helper()
	dir := t.TempDir()
	r := &Runtime{t: t, Node: n, BinDir: binDir, ConfDir: confDir, NetnsDir: filepath.Join(dir, "netns")}
	if r.BinDir == "" {
		r.BinDir = filepath.Join(dir, "cni-bin")
	}
	if r.ConfDir == "" {
		r.ConfDir = filepath.Join(dir, "net.d")
	}
	for _, d := range []string{r.BinDir, r.ConfDir, r.NetnsDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range PrimaryPlugins {
		b, err := os.ReadFile(filepath.Join(pluginsDir, p))
		if err != nil {
			t.Fatalf("CNI plugin %s (run make cni-plugins): %v", p, err)
		}
		if err := os.WriteFile(filepath.Join(r.BinDir, p), b, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	primary := fmt.Sprintf(`{"cniVersion": "1.1.0", "name": "primary", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "dataDir": %q,
            "ranges": [[{"subnet": %q}], [{"subnet": %q}]],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}]}`, filepath.Join(dir, "ipam"), PodSubnet4, PodSubnet6)
	if err := os.WriteFile(filepath.Join(r.ConfDir, "10-primary.conflist"), []byte(primary), 0o644); err != nil {
		t.Fatal(err)
	}
	// Its own shared mount, so that pod netns bound in it later propagate
	// into a node agent's mount namespace (mountPropagation:
	// HostToContainer in istio-cni's chart).
	if err := unix.Mount(r.NetnsDir, r.NetnsDir, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind mount %s: %v", r.NetnsDir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(r.NetnsDir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", r.NetnsDir, err)
		}
	})
	if err := unix.Mount("", r.NetnsDir, "", unix.MS_SHARED, ""); err != nil {
		t.Fatalf("make %s a shared mount: %v", r.NetnsDir, err)
	}
	f, err := os.Open(simnode.NetnsPath(n.NodeNS))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if r.node, err = sockutil.EnterNetns(f); err != nil {
		t.Fatalf("enter netns %s: %v", n.NodeNS, err)
	}
	t.Cleanup(r.node.Close)
	r.cni = libcni.NewCNIConfigWithCacheDir([]string{r.BinDir}, filepath.Join(dir, "cache"), nil)
	return r
}

// Sandbox gives the pod's netns a path in NetnsDir, as the runtime names
// a sandbox's netns, and returns it (CNI_NETNS).
func (r *Runtime) Sandbox(p *simnode.Pod) string {
	r.t.Helper()
	path := filepath.Join(r.NetnsDir, p.NS)
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		r.t.Fatal(err)
	}
	if err := unix.Mount(p.NetnsPath(), path, "", unix.MS_BIND, ""); err != nil {
		r.t.Fatalf("bind netns of pod %s to %s: %v", p.Name, path, err)
	}
	r.t.Cleanup(func() {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			r.t.Errorf("unmount %s: %v", path, err)
		}
		_ = os.Remove(path)
	})
	return path
}

// Conflist is the first conflist of ConfDir, as the runtime loads it.
func (r *Runtime) Conflist() (*libcni.NetworkConfigList, error) {
	files, err := libcni.ConfFiles(r.ConfDir, []string{".conflist"})
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("no conflist in %s: %v", r.ConfDir, err)
	}
	return libcni.ConfListFromFile(files[0])
}

func (r *Runtime) conf(p *simnode.Pod, netns string) *libcni.RuntimeConf {
	id := "sandbox-" + p.UID
	return &libcni.RuntimeConf{ContainerID: id, NetNS: netns, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", p.Namespace}, {"K8S_POD_NAME", p.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", id}, {"K8S_POD_UID", p.UID}}}
}

// Add runs the chain's ADD for the pod's sandbox (its netns at netns) and
// returns the result; an error is a plugin's non-zero exit.
func (r *Runtime) Add(p *simnode.Pod, netns string) (*current.Result, error) {
	var res *current.Result
	err := r.call("add of pod "+p.Namespace+"/"+p.Name, func(ctx context.Context, list *libcni.NetworkConfigList) error {
		out, err := r.cni.AddNetworkList(ctx, list, r.conf(p, netns))
		if err != nil {
			return err
		}
		res, err = current.NewResultFromResult(out)
		return err
	})
	return res, err
}

// Del runs the chain's DEL for the pod's sandbox.
func (r *Runtime) Del(p *simnode.Pod, netns string) error {
	return r.call("del of pod "+p.Namespace+"/"+p.Name, func(ctx context.Context, list *libcni.NetworkConfigList) error {
		return r.cni.DelNetworkList(ctx, list, r.conf(p, netns))
	})
}

// call runs op (a CNI call on the current conflist) on the node netns's
// thread, bounded by a minute; errors name the call (what).
func (r *Runtime) call(what string, op func(context.Context, *libcni.NetworkConfigList) error) error {
	list, err := r.Conflist()
	if err != nil {
		return err
	}
	return r.node.Do(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := op(ctx, list); err != nil {
			return fmt.Errorf("cni %s: %w", what, err)
		}
		return nil
	})
}

// NodeAPI relays c's API server (on the test's loopback) into the node
// netns and returns its address there, 127.0.0.1, where the node's
// processes (plugins, agents) reach it. The relay ends with the test.
func (r *Runtime) NodeAPI(c *kubeapi.Cluster) netip.AddrPort {
	r.t.Helper()
	l, err := r.node.Listen(netip.MustParseAddrPort("127.0.0.1:0"), sockutil.Opts{})
	if err != nil {
		r.t.Fatalf("listen in netns %s: %v", r.Node.NodeNS, err)
	}
	r.t.Cleanup(func() { l.Close() })
	sockutil.Forward(l, strings.TrimPrefix(c.Config.Host, "https://"))
	return sockutil.AddrPort(l.Addr())
}

// Check runs the chain's CHECK for the pod's sandbox (against the result
// libcni cached at its ADD).
func (r *Runtime) Check(p *simnode.Pod, netns string) error {
	return r.call("check of pod "+p.Namespace+"/"+p.Name, func(ctx context.Context, list *libcni.NetworkConfigList) error {
		return r.cni.CheckNetworkList(ctx, list, r.conf(p, netns))
	})
}

// Status runs the chain's STATUS (CNI 1.1: may the runtime send ADDs).
func (r *Runtime) Status() error {
	return r.call("status", func(ctx context.Context, list *libcni.NetworkConfigList) error {
		return r.cni.GetStatusNetworkList(ctx, list)
	})
}

// Chain names the conflist's plugins in order.
func (r *Runtime) Chain() ([]string, error) {
	list, err := r.Conflist()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, p := range list.Plugins {
		out = append(out, p.Network.Type)
	}
	return out, nil
}

// Comparable is a CNI result with what differs between two nodes by
// construction left out (interface names, MACs, sandbox paths): what the
// runtime takes from the chain.
func Comparable(res *current.Result) string {
	c := *res
	c.Interfaces = nil
	for _, i := range res.Interfaces {
		c.Interfaces = append(c.Interfaces, &current.Interface{Name: i.Name, Sandbox: map[bool]string{true: "(sandbox)"}[i.Sandbox != ""]})
	}
	if len(c.Interfaces) > 0 && c.Interfaces[0].Sandbox == "" {
		c.Interfaces[0].Name = "(host veth)"
	}
	b, _ := json.Marshal(c)
	return string(b)
}
