// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package dataplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/bpfobj"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// crashEnv carries a crashJob to this test binary re-run as a child: an
// agent that is SIGKILLed at one failpoint.
const crashEnv = "AMBIENT_EBPF_DATAPLANE_CRASH"

func TestMain(m *testing.M) {
	simnode.RunHelper() // the apps some tests start (simnode.StartApp)
	if job := os.Getenv(crashEnv); job != "" {
		os.Exit(runCrashChild(job))
	}
	os.Exit(m.Run())
}

type crashJob struct {
	BPFFSDir, CgroupRoot, NodeNetns string
	Pod                             Pod
	Remove                          bool             // enroll completely, then crash while removing
	Update                          *podopts.Options // enroll completely, then crash while changing to these options
	Step                            string           // die here ...
	Nth                             int              // ... the nth time it is reached
}

// exitStepNotReached is the child's exit code when it never met its step.
const exitStepNotReached = 3

func runCrashChild(arg string) int {
	var job crashJob
	if err := json.Unmarshal([]byte(arg), &job); err != nil {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		return 1
	}
	seen := 0
	die := func(step string) {
		if step == job.Step {
			if seen++; seen == job.Nth {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // the signal is on its way
			}
		}
	}
	cfg := Config{BPFFSDir: job.BPFFSDir, CgroupRoot: job.CgroupRoot, NodeNetns: job.NodeNetns,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if !job.Remove && job.Update == nil {
		cfg.Failpoint = die
	}
	d, err := New(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "crash child: New:", err)
		return 1
	}
	ctx := context.Background()
	if err := d.Enroll(ctx, job.Pod); err != nil {
		fmt.Fprintln(os.Stderr, "crash child: Enroll:", err)
		return 1
	}
	if job.Update != nil {
		d.cfg.Failpoint = die
		update := job.Pod
		update.Options = *job.Update
		if err := d.Enroll(ctx, update); err != nil {
			fmt.Fprintln(os.Stderr, "crash child: Enroll with new options:", err)
			return 1
		}
	}
	if job.Remove {
		d.cfg.Failpoint = die
		if err := d.Remove(ctx, job.Pod.UID); err != nil {
			fmt.Fprintln(os.Stderr, "crash child: Remove:", err)
			return 1
		}
	}
	return exitStepNotReached
}

// An agent killed (SIGKILL, no cleanup) at any step of enrolment or
// removal leaves the node in a state the next agent turns into "the pod
// fully redirected" or "the pod as it was before enrolment": its sysctl
// value, rules, routes, programs, pins and map entries. The pod's own
// tcp_fwmark_accept (0 here) is never replaced by ours.
func TestCrashAtEveryStepConverges(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	n.Sysctl(p.NS, "net/ipv4/tcp_fwmark_accept", "0")
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	pod := podOf(p)

	probe := newDataplane(t, n)
	programs := len(probe.plan(&pod, p.HostVeth, 0))
	if err := probe.Uninstall(); err != nil {
		t.Fatal(err)
	}

	type crashCase struct {
		job      crashJob
		enrolled bool // what the restarted agent must find
	}
	var cases []crashCase
	for _, step := range Steps {
		nths := 1
		if step == StepEnrollAttached {
			nths = programs
		}
		for nth := 1; nth <= nths; nth++ {
			job := crashJob{BPFFSDir: cfg.BPFFSDir, CgroupRoot: cfg.CgroupRoot, NodeNetns: cfg.NodeNetns, Pod: pod,
				Step: step, Nth: nth, Remove: strings.HasPrefix(step, "remove/")}
			cases = append(cases, crashCase{job: job, enrolled: step == StepEnrollDone})
		}
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s#%d", c.job.Step, c.job.Nth), func(t *testing.T) {
			runCrash(t, c.job)
			d, err := New(cfg)
			if err != nil {
				t.Fatalf("restart after the crash: %v", err)
			}
			defer func() {
				if err := d.Uninstall(); err != nil {
					t.Errorf("Uninstall: %v", err)
				}
			}()
			if c.enrolled {
				checkEnrolled(t, d, p)
				if err := d.Remove(context.Background(), p.UID); err != nil {
					t.Fatalf("Remove: %v", err)
				}
			}
			checkUntouched(t, d, p)
			// A retried enrolment records the pod's own value again.
			if err := d.Enroll(context.Background(), pod); err != nil {
				t.Fatalf("enroll after the crash: %v", err)
			}
			checkEnrolled(t, d, p)
			if err := d.Remove(context.Background(), p.UID); err != nil {
				t.Fatalf("Remove: %v", err)
			}
			checkUntouched(t, d, p)
		})
	}
}

// A return path someone else's redirection uses too (istio-cni's, while a
// takeover from it is under way: Config.SharedReturnPath) outlives the
// undo of an enrolment an agent was killed in: only the rest of the
// enrolment goes. A removal takes it. Without it, istio-cni's redirected inbound
// connections' replies would leave the pod until the next enrolment.
func TestSharedReturnPathOutlivesAnUndoneEnrolment(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	if err := simnode.InNetns(p.NS, func() error {
		h, err := netlink.NewHandle(unix.NETLINK_ROUTE)
		if err != nil {
			return err
		}
		defer h.Close()
		return addReturnPath(h, true) // as istio-cni left it
	}); err != nil {
		t.Fatal(err)
	}
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS),
		SharedReturnPath: func(netns string) bool { return netns == p.NetnsPath() }}
	pod := podOf(p)
	runCrash(t, crashJob{BPFFSDir: cfg.BPFFSDir, CgroupRoot: cfg.CgroupRoot, NodeNetns: cfg.NodeNetns, Pod: pod, Step: StepEnrollAttached, Nth: 1})
	d, err := New(cfg)
	if err != nil {
		t.Fatalf("restart after the crash: %v", err)
	}
	t.Cleanup(func() { _ = d.Uninstall() })
	if got := d.List(); len(got) != 0 {
		t.Errorf("pods after the undo: %+v", got)
	}
	if got := returnRules(t, p); got != 2 {
		t.Errorf("%d return-path rules after the undo, want the 2 of before", got)
	}
	if err := d.Enroll(context.Background(), pod); err != nil {
		t.Fatalf("enroll after the crash: %v", err)
	}
	checkEnrolled(t, d, p)
	if err := d.Remove(context.Background(), p.UID); err != nil {
		t.Fatalf("Remove: %v", err)
	}
	if got := returnRules(t, p); got != 0 {
		t.Errorf("%d return-path rules after Remove, want none: a removal takes it, as istio-cni's would", got)
	}
	if got := skLookupPrograms(t, p); got != 0 {
		t.Errorf("%d sk_lookup programs left after Remove", got)
	}
}

// An agent killed at any step of an options update (R12-R14 changed on an
// enrolled pod, which Enroll applies in place) leaves the pod enrolled, with
// the old options or the new ones; the next agent adopts it, the same
// update done again converges, and going back leaves no program of the
// update behind.
func TestCrashDuringAnOptionsUpdateConverges(t *testing.T) {
	n := simnode.New(t)
	p := n.AddPod("a")
	n.AddVirtualInterface(p, "virt0")
	n.Sysctl(p.NS, "net/ipv4/tcp_fwmark_accept", "0")
	cfg := Config{BPFFSDir: n.BPFFSDir, CgroupRoot: n.CgroupRoot, NodeNetns: simnode.NetnsPath(n.NodeNS)}
	from := podOf(p)
	from.Options = podopts.Options{DNSCapture: true}
	to := from
	to.Options = podopts.Options{BypassInbound: true, RerouteInterfaces: []string{"virt0"}}
	// Before any child pins anything: on kernels that charge BPF memory
	// to the user's RLIMIT_MEMLOCK, this process lifts its own first.
	if err := newDataplane(t, n).Uninstall(); err != nil {
		t.Fatal(err)
	}
	reroutePin := filepath.Join(podDir(cfg, p.UID), "reroute_virt0")
	for _, step := range []string{StepEnrollReturnPath, StepEnrollAttached, StepEnrollEntries, StepEnrollDone} {
		t.Run(step, func(t *testing.T) {
			runCrash(t, crashJob{BPFFSDir: cfg.BPFFSDir, CgroupRoot: cfg.CgroupRoot, NodeNetns: cfg.NodeNetns,
				Pod: from, Update: &to.Options, Step: step, Nth: 1})
			d, err := New(cfg)
			if err != nil {
				t.Fatalf("restart after the crash: %v", err)
			}
			defer func() {
				if err := d.Uninstall(); err != nil {
					t.Errorf("Uninstall: %v", err)
				}
			}()
			checkEnrolled(t, d, p)
			for _, want := range []Pod{to, from} {
				if err := d.Enroll(context.Background(), want); err != nil {
					t.Fatalf("enroll with %+v after the crash: %v", want.Options, err)
				}
				checkEnrolled(t, d, p)
				if got := d.List()[0].Options; got.BypassInbound != want.Options.BypassInbound || got.DNSCapture != want.Options.DNSCapture {
					t.Errorf("options %+v; want %+v", got, want.Options)
				}
				_, err := os.Stat(reroutePin)
				if pinned := err == nil; pinned != (len(want.Options.RerouteInterfaces) > 0) {
					t.Errorf("with options %+v: virt0's program pinned %v", want.Options, pinned)
				}
			}
			if err := d.Remove(context.Background(), p.UID); err != nil {
				t.Fatalf("Remove: %v", err)
			}
			checkUntouched(t, d, p)
		})
	}
}

// runCrash runs job in a child and checks that it died of SIGKILL there.
func runCrash(t *testing.T, job crashJob) {
	t.Helper()
	arg, err := json.Marshal(job)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashEnv+"="+string(arg))
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("crash child: %v (output %q)", err, out)
	}
	if st, ok := exit.Sys().(syscall.WaitStatus); !ok || !st.Signaled() || st.Signal() != syscall.SIGKILL {
		t.Fatalf("crash child did not die at %s#%d: %v (output %q)", job.Step, job.Nth, err, out)
	}
}

func checkEnrolled(t *testing.T, d *Dataplane, p *simnode.Pod) {
	t.Helper()
	if got := d.List(); len(got) != 1 || got[0].UID != p.UID {
		t.Errorf("enrolled pods = %+v, want %s", got, p.UID)
	}
	if got := fwmarkAccept(t, p); got != "1" {
		t.Errorf("tcp_fwmark_accept = %s while enrolled, want 1", got)
	}
	if got := ingressPrograms(t, p); got != 1 {
		t.Errorf("%d programs on the pod's lo, want 1", got)
	}
	if got := returnRules(t, p); got != 2 {
		t.Errorf("%d return-path rules, want 2", got)
	}
}

func checkUntouched(t *testing.T, d *Dataplane, p *simnode.Pod) {
	t.Helper()
	if got := d.List(); len(got) != 0 {
		t.Errorf("enrolled pods = %+v, want none", got)
	}
	if got := fwmarkAccept(t, p); got != "0" {
		t.Errorf("tcp_fwmark_accept = %s, want the pod's own 0", got)
	}
	if got := ingressPrograms(t, p); got != 0 {
		t.Errorf("%d programs left on the pod's lo", got)
	}
	for _, attach := range []ebpf.AttachType{ebpf.AttachTCXIngress, ebpf.AttachTCXEgress} {
		n, err := classicHooks{}.count(d.cfg.NodeNetns, p.HostVeth, attach)
		if err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%d programs left on the node side of the veth (%s)", n, attach)
		}
	}
	if got := skLookupPrograms(t, p); got != 0 {
		t.Errorf("%d sk_lookup programs left in the pod netns", got)
	}
	if got := returnRules(t, p); got != 0 {
		t.Errorf("%d return-path rules left", got)
	}
	if entries, _ := os.ReadDir(podsDir(d.cfg)); len(entries) != 0 {
		t.Errorf("pod pins left: %v", entries)
	}
	if got := countEntries[uint64, bpfobj.SockNetnsInfo](t, d.sock.AeNetns); got != 0 {
		t.Errorf("ae_netns has %d entries", got)
	}
	if got := countEntries[bpfobj.SockAeAddr, bpfobj.SockPodInfo](t, d.sock.AePods); got != 0 {
		t.Errorf("ae_pods has %d entries", got)
	}
	pods, err := readPods(&d.sock.SockMaps)
	if err != nil {
		t.Fatal(err)
	}
	if len(pods) != 0 {
		t.Errorf("journal still names %d pods", len(pods))
	}
}

func fwmarkAccept(t *testing.T, p *simnode.Pod) string {
	t.Helper()
	var v []byte
	if err := simnode.InNetns(p.NS, func() (err error) {
		v, err = os.ReadFile(filepath.Join("/proc/sys", fwmarkAcceptKey[len("sys/"):]))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(v))
}

func returnRules(t *testing.T, p *simnode.Pod) int {
	t.Helper()
	n := 0
	if err := simnode.InNetns(p.NS, func() error {
		for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
			rules, err := netlink.RuleList(fam)
			if err != nil {
				return err
			}
			for _, r := range rules {
				if r.Table == returnTable && r.Priority == returnRulePrio {
					n++
				}
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

func skLookupPrograms(t *testing.T, p *simnode.Pod) int {
	t.Helper()
	ns, err := os.Open(p.NetnsPath())
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: int(ns.Fd()), Attach: ebpf.AttachSkLookup})
	if err != nil {
		t.Fatalf("query sk_lookup programs: %v", err)
	}
	return len(res.Programs)
}
