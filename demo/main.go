// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Command demo runs a self-contained ambient-ebpf node on this machine:
// a node netns, pods created through the real CNI chain (ptp + host-local,
// then ambient-ebpf-cni), the agent in standalone mode with the pods of
// demo/pods.yaml, and a ztunnel stand-in receiving pods over ZDS. It sends
// real traffic, prints what happened, and removes everything it made when
// it ends or is interrupted. `make demo` builds and runs it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podfile"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

func main() {
	simnode.RunHelper() // the demo's helper processes are this binary
	bin := flag.String("bin", "bin", "directory with ambient-ebpf-agent, ambient-ebpf-cni and ambient-ebpf")
	plugins := flag.String("cni-plugins", ".cache/cni-plugins/v1.10.0", "directory with the ptp, host-local and loopback plugins")
	pods := flag.String("pods", "demo/pods.yaml", "the pod file")
	flag.Parse()
	os.Exit(run(os.Stdout, *bin, *plugins, *pods))
}

// fatal carries a Fatal from the harness to run's recover.
type fatal struct{ msg string }

// runner is the harness's TB for a program: cleanups run in reverse on
// every exit path, Ctrl-C included.
type runner struct {
	mu       sync.Mutex
	cleanups []func()
	once     sync.Once
	tmp      string
	out      io.Writer
}

func (r *runner) Helper()                   {}
func (r *runner) Fatal(args ...any)         { panic(fatal{fmt.Sprint(args...)}) }
func (r *runner) Fatalf(f string, a ...any) { panic(fatal{fmt.Sprintf(f, a...)}) }
func (r *runner) Errorf(f string, a ...any) { fmt.Fprintf(os.Stderr, "demo: cleanup: "+f+"\n", a...) }
func (r *runner) Cleanup(f func()) {
	r.mu.Lock()
	r.cleanups = append(r.cleanups, f)
	r.mu.Unlock()
}

func (r *runner) TempDir() string {
	d, err := os.MkdirTemp(r.tmp, "t")
	if err != nil {
		r.Fatal(err)
	}
	return d
}

func (r *runner) cleanup() {
	r.once.Do(func() {
		r.mu.Lock()
		fs := r.cleanups
		r.cleanups = nil
		r.mu.Unlock()
		for i := len(fs) - 1; i >= 0; i-- {
			fs[i]()
		}
		os.RemoveAll(r.tmp)
	})
}

func run(out io.Writer, bin, plugins, podsPath string) (code int) {
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "demo: run as root (it creates network namespaces, cgroups and BPF programs)")
		return 2
	}
	tmp, err := os.MkdirTemp("", "ambient-ebpf-demo-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		return 1
	}
	r := &runner{tmp: tmp, out: out}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		<-sigs
		fmt.Fprintln(os.Stderr, "\ndemo: interrupted; cleaning up")
		r.cleanup()
		os.Exit(130)
	}()
	defer r.cleanup()
	defer func() {
		if v := recover(); v != nil {
			f, ok := v.(fatal)
			if !ok {
				panic(v)
			}
			fmt.Fprintln(os.Stderr, "demo:", f.msg)
			code = 1
		}
	}()
	d := &demo{r: r, out: out, bin: bin, plugins: plugins, podsPath: podsPath}
	d.run()
	return 0
}

type demo struct {
	r                      *runner
	out                    io.Writer
	bin, plugins, podsPath string
	node                   *simnode.Node
	file                   *podfile.File
	pods                   map[string]*simnode.Pod // by name
	ambient                map[string]bool
	cni                    *libcni.CNIConfig
	list                   *libcni.NetworkConfigList
	agent                  *agentrun.Node
	zt                     *simnode.Ztunnel
	inNode                 func(func() error) error
}

func (d *demo) step(format string, a ...any) { fmt.Fprintf(d.out, "\n== "+format+"\n", a...) }

func (d *demo) run() {
	abs := func(p string) string {
		a, err := filepath.Abs(p)
		if err != nil {
			d.r.Fatal(err)
		}
		return a
	}
	d.bin, d.plugins, d.podsPath = abs(d.bin), abs(d.plugins), abs(d.podsPath)
	var err error
	if d.file, err = podfile.Load(d.podsPath); err != nil {
		d.r.Fatal(err)
	}

	d.step("a node: its own netns, an outside host, a private bpffs, a cgroup subtree")
	d.node = simnode.New(d.r)
	f, err := os.Open(simnode.NetnsPath(d.node.NodeNS))
	if err != nil {
		d.r.Fatal(err)
	}
	d.r.Cleanup(func() { f.Close() })
	nodeNS, err := sockutil.EnterNetns(f)
	if err != nil {
		d.r.Fatal(err)
	}
	d.r.Cleanup(nodeNS.Close)
	d.inNode = nodeNS.Do
	fmt.Fprintf(d.out, "node netns %s, outside host %s, pins under %s\n", d.node.NodeNS, simnode.OutsideV4, d.node.BPFFSDir)
	d.agent = agentrun.New(d.r, d.node, agentrun.Options{BinDir: d.bin, NodeName: "demo-node", PodFile: d.podsPath, InstallCNI: true})

	d.setupCNI()
	d.startAgent()
	d.addPods()
	d.traffic()
	d.inspect()
	d.teardown()
}

// setupCNI writes the primary CNI's conflist (ptp + host-local); the
// agent's installer chains ambient-ebpf-cni into it.
func (d *demo) setupCNI() {
	d.step("CNI: ptp + host-local as the primary network; the agent's installer adds ambient-ebpf-cni")
	for _, p := range []string{"ptp", "host-local", "loopback"} {
		if err := copyFile(filepath.Join(d.plugins, p), filepath.Join(d.agent.CNIBinDir, p)); err != nil {
			d.r.Fatalf("CNI plugin %s (run `make cni-plugins`): %v", p, err)
		}
	}
	primary := fmt.Sprintf(`{"cniVersion": "1.1.0", "name": "demo", "plugins": [
  {"type": "ptp", "ipMasq": false, "mtu": 1500,
   "ipam": {"type": "host-local", "dataDir": %q,
            "ranges": [[{"subnet": "198.18.100.0/24"}], [{"subnet": "fd00:198:18:100::/64"}]],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}}]}`, d.r.TempDir())
	if err := os.WriteFile(filepath.Join(d.agent.CNIConfDir, "10-demo.conflist"), []byte(primary), 0o644); err != nil {
		d.r.Fatal(err)
	}
	d.cni = libcni.NewCNIConfigWithCacheDir([]string{d.agent.CNIBinDir}, d.r.TempDir(), nil)
}

func (d *demo) startAgent() {
	d.step("the agent (standalone: pods from %s), and ztunnel connecting over ZDS", filepath.Base(d.podsPath))
	d.agent.StartAgent(d.r, "--uninstall-on-exit")
	if _, err := d.agent.WaitReady(); err != nil {
		d.r.Fatal(err)
	}
	fmt.Fprintln(d.out, "agent ready: the CNI plugin is chained and the agent serves")
	d.zt = d.node.StartZtunnelFor(d.agent.ZDS)
	d.agent.WaitZtunnel(d.r)
	fmt.Fprintln(d.out, "ztunnel stand-in connected over ZDS (/var/run/ztunnel/ztunnel.sock in production)")
}

func (d *demo) runtimeConf(p *simnode.Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: "demo-" + p.Name, NetNS: p.NetnsPath(), IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", p.Namespace}, {"K8S_POD_NAME", p.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", "demo-" + p.Name}, {"K8S_POD_UID", p.UID}}}
}

// addPods creates each pod's sandbox the way a container runtime does:
// a netns, then the CNI chain's ADD.
func (d *demo) addPods() {
	d.step("pods: sandboxes created through the CNI chain, as a container runtime would")
	files, err := libcni.ConfFiles(d.agent.CNIConfDir, []string{".conflist"})
	if err != nil || len(files) == 0 {
		d.r.Fatalf("no conflist in %s: %v", d.agent.CNIConfDir, err)
	}
	if d.list, err = libcni.ConfListFromFile(files[0]); err != nil {
		d.r.Fatal(err)
	}
	var chain []string
	for _, p := range d.list.Plugins {
		chain = append(chain, p.Network.Type)
	}
	fmt.Fprintf(d.out, "conflist %s: %s\n", filepath.Base(files[0]), strings.Join(chain, " -> "))

	d.pods, d.ambient = map[string]*simnode.Pod{}, map[string]bool{}
	for _, kp := range d.file.Pods {
		p := d.node.AddBarePod(kp.Name, kp.Namespace, string(kp.UID))
		d.pods[kp.Name] = p
		var res types.Result
		err := d.inNode(func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			var err error
			res, err = d.cni.AddNetworkList(ctx, d.list, d.runtimeConf(p))
			return err
		})
		if err != nil {
			d.r.Fatalf("CNI ADD %s/%s: %v\nagent log:\n%s", kp.Namespace, kp.Name, err, d.agent.Agent.Output.String())
		}
		d.r.Cleanup(func() { d.del(p) })
		cur, err := current.NewResultFromResult(res)
		if err != nil {
			d.r.Fatal(err)
		}
		for _, ip := range cur.IPs {
			a, _ := netip.AddrFromSlice(ip.Address.IP)
			if a.Unmap().Is4() {
				p.V4 = a.Unmap()
			} else {
				p.V6 = a
			}
		}
		dec := enrollment.Decide(enrollment.DefaultConfig(), kp, d.file.Namespaces[kp.Namespace])
		d.ambient[kp.Name] = dec.Ambient
		state := "passes through (not ambient: " + string(dec.Reason) + ")"
		if dec.Ambient {
			state = "enrolled before its app starts (" + string(dec.Reason) + ")"
		}
		fmt.Fprintf(d.out, "  %-16s %-15s %-24s %s\n", kp.Namespace+"/"+kp.Name, p.V4, p.V6, state)
	}
}

func (d *demo) del(p *simnode.Pod) {
	_ = d.inNode(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return d.cni.DelNetworkList(ctx, d.list, d.runtimeConf(p))
	})
}

func (d *demo) traffic() {
	d.step("traffic")
	any6 := netip.IPv6Unspecified()
	outside := d.node.StartOutsideApp()
	outside.Listen("tcp", "outside web server", netip.AddrPortFrom(any6, 8080))
	if _, err := outside.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(any6, 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		d.r.Fatal(err)
	}
	apps := map[string]*simnode.App{}
	for name, p := range d.pods {
		apps[name] = d.node.StartApp(p)
		apps[name].Listen("tcp", name, netip.AddrPortFrom(any6, 8080))
	}
	kubelet := d.node.StartNodeApp()

	frontend, backend := d.pods["frontend"], d.pods["backend"]
	d.show("frontend -> backend (pod to pod)", apps["frontend"], netip.AddrPortFrom(backend.V4, 8080), "")
	d.show("frontend -> outside server", apps["frontend"], netip.AddrPortFrom(simnode.OutsideV4, 8080), "")
	d.show("frontend -> outside server over IPv6", apps["frontend"], netip.AddrPortFrom(simnode.OutsideV6, 8080), "")
	d.show("outside client -> backend (inbound)", outside, netip.AddrPortFrom(backend.V4, 8080), "")
	d.show("kubelet-style probe -> frontend", kubelet, netip.AddrPortFrom(frontend.V4, 8080), "; the probe kept the node's own address (direct host probes)")
	d.show("batch (not in the mesh) -> outside server", apps["batch"], netip.AddrPortFrom(simnode.OutsideV4, 8080), "")

	name := "backend.shop." + simnode.KnownDNSSuffix
	server := netip.AddrPortFrom(simnode.OutsideV4, 53)
	resp, err := apps["frontend"].Do(simnode.AppRequest{Op: "dns", Addr: server, DNSName: name, Proto: "udp"})
	if err != nil {
		d.r.Fatalf("DNS query: %v", err)
	}
	via := "answered directly by the outside server"
	for _, rec := range d.zt.Records() {
		if rec.DNSName == name+"." {
			via = "answered by ztunnel's DNS proxy (:15053)"
		}
	}
	fmt.Fprintf(d.out, "  %-44s %s -> %s, %s; the app saw the reply come from %s\n", "frontend DNS query to "+server.String(), name, resp.Answer, via, resp.From)
}

// show dials dst from app and says who answered, what they saw, and what
// ztunnel recorded; direct is said of a connection that reached its server
// without ztunnel, from an address other than the probe SNAT address.
func (d *demo) show(what string, app *simnode.App, dst netip.AddrPort, direct string) {
	resp, err := app.Dial("tcp", simnode.AppRequest{Addr: dst})
	if err != nil {
		d.r.Fatalf("%s: %v", what, err)
	}
	line := fmt.Sprintf("reached %q, which saw the client as %s", resp.Reply.Server, resp.Reply.Peer.Addr())
	if rec, ok := d.zt.RecordFor(resp.Local); ok {
		line += fmt.Sprintf("; via ztunnel :%d, original destination %s (%s)", rec.Listener, rec.OrigDst, rec.OrigDstFrom)
	} else {
		line += "; not through ztunnel"
	}
	if resp.Reply.Peer.Addr() == simnode.ProbeV4 {
		line += "; the probe arrived from the probe SNAT address"
	} else if _, via := d.zt.RecordFor(resp.Local); !via {
		line += direct
	}
	fmt.Fprintf(d.out, "  %-44s %s\n", what, line)
	for _, rec := range d.zt.Records() {
		if rec.Listener == standin.InboundPort && rec.OrigDst == dst && rec.Peer.Addr() == resp.Local.Addr() {
			fmt.Fprintf(d.out, "  %-44s ztunnel :15006 took it inbound at the destination pod (original destination %s)\n", "", rec.OrigDst)
			break
		}
	}
}

func (d *demo) inspect() {
	for _, args := range [][]string{{"status"}, {"pods"}, {"stats"}, {"maps"}} {
		d.step("ambient-ebpf %s", strings.Join(args, " "))
		cmd := exec.Command(filepath.Join(d.bin, "ambient-ebpf"), append([]string{"--bpffs", d.node.BPFFSDir, "--inspect-socket", d.agent.Inspect}, args...)...)
		cmd.Stdout, cmd.Stderr = d.out, d.out
		if err := cmd.Run(); err != nil {
			d.r.Fatalf("ambient-ebpf %s: %v", args[0], err)
		}
	}
	fmt.Fprintf(d.out, "\n(bpftool prints the same maps with BTF field names: bpftool map dump pinned %s/maps/ae_pods)\n", d.node.BPFFSDir)
}

// teardown removes the pods through the CNI chain and stops the agent,
// which uninstalls (the demo node is going away).
func (d *demo) teardown() {
	d.step("cleanup: CNI DEL for every pod, the agent uninstalls, the node is removed")
	for _, p := range d.pods {
		d.del(p)
	}
	if err := d.agent.Stop(15 * time.Second); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
	}
	if _, err := os.Stat(d.node.BPFFSDir); !errors.Is(err, os.ErrNotExist) {
		d.r.Fatalf("pins left after the agent's uninstall: %v", err)
	}
	fmt.Fprintln(d.out, "agent stopped; no pins left")
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}

var _ simnode.TB = (*runner)(nil)
