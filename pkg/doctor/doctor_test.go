// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package doctor

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

func TestMain(m *testing.M) {
	simnode.RunHelper() // the ztunnel stand-in the listeners check meets
	os.Exit(m.Run())
}

// want is a finding expected in a report: its check, status, and words
// its summary must contain.
type want struct {
	check  string
	status Status
	words  []string
}

func requireFindings(t *testing.T, r *Report, wants ...want) {
	t.Helper()
	for _, w := range wants {
		found := false
		for _, f := range r.Findings {
			if f.Check != w.check || f.Status != w.status {
				continue
			}
			all := true
			for _, word := range w.words {
				all = all && strings.Contains(f.Summary, word)
			}
			if all {
				found = true
				if (f.Status == Warn || f.Status == Fail) && (f.Meaning == "" || f.Action == "") {
					t.Errorf("%s finding %q says no meaning or action", f.Status, f.Summary)
				}
			}
		}
		if !found {
			t.Errorf("no %s %s finding with %q; report:\n%s", w.status, w.check, w.words, dump(r))
		}
	}
}

func dump(r *Report) string {
	var b strings.Builder
	for _, f := range r.Findings {
		fmt.Fprintf(&b, "  %-5s %-24s %s\n", f.Status, f.Check, f.Summary)
	}
	return b.String()
}

func forbidStatus(t *testing.T, r *Report, check string, statuses ...Status) {
	t.Helper()
	for _, f := range r.Findings {
		for _, s := range statuses {
			if f.Check == check && f.Status == s {
				t.Errorf("unexpected %s %s finding: %s", s, check, f.Summary)
			}
		}
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

const (
	primaryConf = `{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"ptp"},{"type":"portmap"}]}`
	chainedConf = `{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"ptp"},{"type":"ambient-ebpf-cni"}]}`
)

// The doctor on a simulated node before install, after install, and with
// other software on every hook it checks: each finding names what it
// found, and only real breakage fails.
func TestDoctorBeforeAndAfterInstallAndWithConflicts(t *testing.T) {
	n := simnode.New(t)
	pod := n.AddPod("web")
	confDir := t.TempDir()
	writeFile(t, filepath.Join(confDir, "10-podnet.conflist"), primaryConf)
	zdsSocket := filepath.Join(t.TempDir(), "ztunnel.sock")
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), CNIConfDir: confDir, ZDSSocket: zdsSocket}
	ctx := context.Background()

	t.Run("before_install", func(t *testing.T) {
		r := Run(ctx, cfg)
		requireFindings(t, r,
			want{"kernel", OK, []string{"Linux ", "this binary " + runtime.GOOS + "/" + runtime.GOARCH}},
			want{"feature/sk_lookup", OK, []string{"available (Linux 5.9)"}},
			want{"cgroup2", OK, []string{"the socket hooks attach to " + n.CgroupRoot}},
			want{"bpffs", OK, []string{"bpffs mounted at " + filepath.Dir(n.BPFFSDir)}},
			want{"datapath", Info, []string{"no data path pinned at " + n.BPFFSDir}},
			want{"cni", Info, []string{"the runtime uses " + filepath.Join(confDir, "10-podnet.conflist"), `"podnet"`, "ptp -> portmap", "ambient-ebpf-cni is not in it"}},
			want{"ztunnel", Warn, []string{"no ZDS socket at " + zdsSocket}},
			want{"istio-cni", OK, []string{"no istio-cni iptables chains"}},
		)
		if r.Failed() {
			t.Errorf("a node ready for install fails:\n%s", dump(r))
		}
	})

	// With the sockmap acceleration on: its sockops program beside ours is
	// not another program on our hooks.
	// Host probes SNATed: the node side of the veth has programs to check.
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), SockmapAccel: accel.ToZtunnel,
		HostProbes: bpfobj.ProbeSNAT})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dp.Uninstall() })
	if err := dp.Enroll(ctx, dataplane.Pod{UID: pod.UID, Namespace: "shop", Name: "web", Netns: pod.NetnsPath(), IPs: pod.IPs()}); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(confDir, "10-podnet.conflist"), chainedConf)
	ln := listenZDS(t, zdsSocket)

	t.Run("after_install", func(t *testing.T) {
		r := Run(ctx, cfg)
		requireFindings(t, r,
			want{"datapath", OK, []string{"data path pinned at " + n.BPFFSDir, "1 pods enrolled"}},
			want{"cgroup-hooks", OK, []string{"our 10 socket hooks are attached to " + n.CgroupRoot}},
			want{"tc-hooks", OK, []string{"all 4 per-pod hooks have our program"}},
			want{"host-probes", OK, []string{"snat: kubelet's probes reach enrolled pods"}},
			want{"cni", OK, []string{"ptp -> ambient-ebpf-cni", "CNI 1.0.0"}},
			want{"ztunnel", Warn, []string{"the agent listens on " + zdsSocket, "no ztunnel is connected"}},
		)
		conn, err := net.Dial("unixpacket", zdsSocket)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		accepted, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer accepted.Close()
		r = Run(ctx, cfg)
		requireFindings(t, r, want{"ztunnel", OK, []string{"the agent listens on " + zdsSocket, "1 ztunnel connection(s)"}})
		if r.Failed() {
			t.Errorf("an installed node fails:\n%s", dump(r))
		}
		forbidStatus(t, r, "trace", Info, Warn, Fail) // nobody traces
		if skLookupInbound() {
			// No ztunnel has been handed the pod: nothing listens in it.
			requireFindings(t, r, want{"listeners", Warn, []string{"1 enrolled pods have no ztunnel inbound listener filed: shop/web"}})
		} else {
			forbidStatus(t, r, "listeners", OK, Info, Warn, Fail)
		}
		if features.HasSockmapAccel() {
			requireFindings(t, r, want{"sockmap", Info, []string{"sockmap acceleration on: 0 senders and 0 receivers"}})
			requireFindings(t, r, want{"cgroup-hooks", OK, []string{"no other program on the socket hooks"}})
		} else {
			forbidStatus(t, r, "sockmap", Info, Warn, Fail)
		}
	})

	t.Run("listeners", func(t *testing.T) {
		if !skLookupInbound() {
			t.Log("inbound goes through tc on this kernel: ae_listeners is not used") // no skip: the check must stay silent
			forbidStatus(t, Run(ctx, cfg), "listeners", OK, Info, Warn, Fail)
			return
		}
		n.StartZtunnel().Add(pod) // it listens in the pod, and sockops files that
		r := Run(ctx, cfg)
		requireFindings(t, r, want{"listeners", OK, []string{"every enrolled pod has ztunnel's inbound listener filed (ae_listeners: "}})
		forbidStatus(t, r, "listeners", Warn, Fail)
	})

	t.Run("conflicts", func(t *testing.T) {
		// A socket load balancer on the pod's cgroup, a TCX program and a
		// classic filter ahead of ours, istio-cni's leftovers, our filter
		// on the pod's lo deleted, a CNI chain with istio-cni and ours first.
		lb := attachCgroupProgram(t, pod.Cgroup, "cil_sock4_connect", ebpf.AttachCGroupInet4Connect)
		n.AttachTCX(n.NodeNS, pod.HostVeth, ebpf.AttachTCXIngress, passProgram(t, "primary_in", ebpf.SchedCLS, ebpf.AttachTCXIngress, -1))
		n.AddTCFilter(n.NodeNS, pod.HostVeth, ebpf.AttachTCXEgress, passProgram(t, "primary", ebpf.SchedCLS, ebpf.AttachNone, -1), "primary-cni")
		iptables(t, simnode.NetnsPath(n.NodeNS), "-t", "nat", "-N", "ISTIO_POSTRT")
		iptables(t, pod.NetnsPath(), "-t", "nat", "-N", "ISTIO_OUTPUT")
		// A tracer that died left the events on (maps/ae_tracing, doc.go).
		flag, err := ebpf.LoadPinnedMap(filepath.Join(n.BPFFSDir, "maps", "ae_tracing"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := flag.Put(uint32(0), uint32(1)); err != nil {
			t.Fatal(err)
		}
		flag.Close()
		deleteOurFilter(t, pod.NS, "lo")
		writeFile(t, filepath.Join(confDir, "10-podnet.conflist"),
			`{"cniVersion":"1.0.0","name":"podnet","plugins":[{"type":"ambient-ebpf-cni"},{"type":"ptp"},{"type":"istio-cni"}]}`)
		writeFile(t, filepath.Join(confDir, "05-broken.conf"), `{"cniVersion":`)

		r := Run(ctx, cfg)
		requireFindings(t, r,
			want{"cgroup-hooks", Warn, []string{"program cil_sock4_conne", fmt.Sprintf("(id %d)", lb), "on connect4 of " + pod.Cgroup}},
			want{"tc-hooks", Warn, []string{"tcx primary_in runs before ours at host_ingress of 1 pods (shop/web)"}},
			want{"host-probes", Warn, []string{"another program takes the pods' replies first on 1 pods (shop/web)"}},
			want{"tc-hooks", Warn, []string{"bpf primary-cni (priority 1) runs before ours at host_egress of 1 pods (shop/web)"}},
			want{"tc-hooks", Fail, []string{"pod shop/web: our program is missing from ingress on lo (lo_ingress)"}},
			want{"istio-cni", Warn, []string{"the node still has istio-cni's host rules", "ISTIO_POSTRT"}},
			want{"istio-cni", Warn, []string{"pod shop/web still has istio-cni's in-pod rules", "ISTIO_OUTPUT"}},
			want{"cni", Fail, []string{filepath.Join(confDir, "05-broken.conf") + " does not parse"}},
			want{"cni", Fail, []string{"ambient-ebpf-cni is first in " + filepath.Join(confDir, "10-podnet.conflist")}},
			want{"cni", Warn, []string{"istio-cni is chained in"}},
			want{"trace", Warn, []string{"the programs write trace events, but nobody reads them"}},
		)
		for _, f := range r.Findings {
			if f.Check == "cgroup-hooks" && strings.Contains(f.Summary, "cil_sock") && !strings.Contains(f.Action, "socketLB.hostNamespaceOnly=true") {
				t.Errorf("the socket load balancer finding does not say how to configure Cilium: %+v", f)
			}
		}
		forbidStatus(t, r, "datapath", Warn, Fail)
		if !r.Failed() {
			t.Error("a node with a broken CNI chain and a missing program does not fail")
		}
	})
}

func listenZDS(t *testing.T, path string) *net.UnixListener {
	t.Helper()
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

func passProgram(t *testing.T, name string, typ ebpf.ProgramType, attach ebpf.AttachType, ret int32) *ebpf.Program {
	t.Helper()
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Name: name, Type: typ, AttachType: attach, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()}})
	if err != nil {
		t.Fatalf("load %s: %v", name, err)
	}
	t.Cleanup(func() { prog.Close() })
	return prog
}

// attachCgroupProgram attaches a program that lets every call proceed and
// returns its id.
func attachCgroupProgram(t *testing.T, cgroup, name string, attach ebpf.AttachType) uint32 {
	t.Helper()
	prog := passProgram(t, name, ebpf.CGroupSockAddr, attach, 1)
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cgroup, Attach: attach, Program: prog})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	info, err := prog.Info()
	if err != nil {
		t.Fatal(err)
	}
	id, _ := info.ID()
	return uint32(id)
}

func iptables(t *testing.T, netns string, args ...string) {
	t.Helper()
	if out, err := exec.Command("nsenter", append([]string{"--net=" + netns, "iptables-legacy"}, args...)...).CombinedOutput(); err != nil {
		t.Fatalf("iptables %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// deleteOurFilter deletes the data path's tc filter from an interface in
// the pod, as a misbehaving CNI would.
func deleteOurFilter(t *testing.T, ns, iface string) {
	t.Helper()
	if err := simnode.InNetns(ns, func() error {
		l, err := netlink.LinkByName(iface)
		if err != nil {
			return err
		}
		filters, err := netlink.FilterList(l, netlink.HANDLE_MIN_INGRESS)
		if err != nil {
			return err
		}
		for _, f := range filters {
			if f.Attrs().Priority == 0xae00 {
				return netlink.FilterDel(f)
			}
		}
		return unix.ENOENT
	}); err != nil {
		t.Fatalf("delete our filter on %s: %v", iface, err)
	}
}

// skLookupInbound says whether the data path files ztunnel's listeners
// (ae_listeners) on this kernel: only where sk_lookup alone captures
// inbound.
func skLookupInbound() bool {
	return features.HasSkLookupIfindex() && features.HasNetnsCookieSockops()
}

// A program that holds a socket hook alone (attached without
// BPF_F_ALLOW_MULTI) fails the doctor before install, naming it and the
// bpftool command that detaches it: the agent could not start.
func TestDoctorNamesAProgramThatHoldsAHookAlone(t *testing.T) {
	n := simnode.New(t)
	n.AttachExclusive(ebpf.AttachCGroupInet4Connect, "lb_sock4_conn")
	r := Run(context.Background(), Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), CNIConfDir: t.TempDir()})
	requireFindings(t, r, want{"cgroup-hooks", Fail, []string{"program lb_sock4_conn (id ", "holds connect4 of cgroup " + n.CgroupRoot + " exclusively"}})
	for _, f := range r.Findings {
		if f.Status == Fail && f.Check == "cgroup-hooks" && !strings.Contains(f.Action, "bpftool cgroup detach "+n.CgroupRoot+" connect4 id ") {
			t.Errorf("the finding's action names no detach command: %+v", f)
		}
	}
}

// With the socket programs on the pods' cgroup, a socket load balancer at
// the root runs after ours for the pods' sockets: doctor says so and does
// not warn about it.
func TestDoctorSaysALoadBalancerAtTheRootRunsAfterOurs(t *testing.T) {
	n := simnode.New(t)
	n.AttachSocketLB(netip.MustParseAddrPort("198.18.255.10:80"), netip.MustParseAddrPort("198.18.0.20:8080"))
	dp, err := dataplane.New(dataplane.Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, PodsCgroup: n.PodsCgroup, NodeNetns: simnode.NetnsPath(n.NodeNS)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dp.Uninstall() })
	r := Run(context.Background(), Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS), CNIConfDir: t.TempDir()})
	requireFindings(t, r,
		want{"cgroup-hooks", OK, []string{"our 10 socket hooks are attached to " + n.PodsCgroup}},
		want{"cgroup-hooks", Info, []string{"program lb_connect4 (id ", "on connect4 of " + n.CgroupRoot}})
	for _, f := range r.Findings {
		if f.Check == "cgroup-hooks" && strings.Contains(f.Summary, "lb_connect4") && !strings.Contains(f.Meaning, "runs after ours for the pods' sockets") {
			t.Errorf("the load balancer's finding does not say it runs after ours: %+v", f)
		}
	}
}

// The kernel finding compares the kernel's machine with the binary's
// architecture by Go's names, and warns naming the build to run.
func TestKernelFindingWarnsOnAnotherArchitecture(t *testing.T) {
	for _, tc := range []struct {
		machine, arch string
		want          Status
	}{
		{"x86_64", "amd64", OK}, {"aarch64", "arm64", OK}, {"riscv64", "amd64", OK},
		{"aarch64", "amd64", Warn}, {"x86_64", "arm64", Warn},
	} {
		f := kernelFinding("6.18.0", tc.machine, tc.arch)
		if f.Status != tc.want || !strings.Contains(f.Summary, "this binary linux/"+tc.arch) {
			t.Errorf("%s kernel, %s binary: %s %q", tc.machine, tc.arch, f.Status, f.Summary)
		}
		if tc.want == Warn && !strings.Contains(f.Action, "built for "+goArch(tc.machine)) {
			t.Errorf("%s kernel, %s binary: action %q names no build", tc.machine, tc.arch, f.Action)
		}
	}
}
