// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock/unixsocktest"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback/decide"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

// fakeAgent records calls and answers with err (nil: enrolled).
type fakeAgent struct {
	mu   sync.Mutex
	adds []*cniv1.PodAddRequest
	dels []*cniv1.PodDelRequest
	err  error
}

func (f *fakeAgent) PodAdd(_ context.Context, req *cniv1.PodAddRequest) (*cniv1.PodAddResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.adds = append(f.adds, req)
	if f.err != nil {
		return nil, f.err
	}
	return &cniv1.PodAddResponse{Enrolled: true}, nil
}

func (f *fakeAgent) PodDel(_ context.Context, req *cniv1.PodDelRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dels = append(f.dels, req)
	return f.err
}

func (f *fakeAgent) Close() error { return nil }

// fakeSource answers lookups from fixed objects, or with err.
type fakeSource struct {
	pods map[string]*corev1.Pod
	nss  map[string]*corev1.Namespace
	err  error
}

func (f *fakeSource) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	if f.err != nil {
		return nil, nil, f.err
	}
	p := f.pods[namespace+"/"+name]
	if p == nil {
		return nil, nil, fmt.Errorf("pod %s/%s not found", namespace, name)
	}
	return p, f.nss[namespace], nil
}

func pod(ns, name string, labels map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels}}
}

func namespace(name string, labels map[string]string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}
}

var ambient = map[string]string{"istio.io/dataplane-mode": "ambient"}

func testSource() *fakeSource {
	return &fakeSource{
		pods: map[string]*corev1.Pod{
			"mesh/web":    pod("mesh", "web", nil),
			"plain/web":   pod("plain", "web", nil),
			"plain/amb":   pod("plain", "amb", ambient),
			"mesh/optout": pod("mesh", "optout", map[string]string{"istio.io/dataplane-mode": "none"}),
		},
		nss: map[string]*corev1.Namespace{"mesh": namespace("mesh", ambient), "plain": namespace("plain", nil)},
	}
}

type harness struct {
	p      *Plugin
	out    *bytes.Buffer
	agent  *fakeAgent
	dialed int
}

// newHarness wires a plugin to agent (nil: the dial fails) and src (nil: no
// fallback configured).
func newHarness(agent *fakeAgent, src decide.PodSource) *harness {
	h := &harness{out: &bytes.Buffer{}, agent: agent}
	h.p = &Plugin{
		Stdout: h.out,
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		DialAgent: func(*Config) (Agent, error) {
			h.dialed++
			if agent == nil {
				return nil, errors.New("dial unix /run/x.sock: connect: no such file or directory")
			}
			return agent, nil
		},
		Fallback:   inProcessFallback(func(*Config) decide.PodSource { return src }),
		ProbeAgent: func(context.Context, *Config) error { return nil },
	}
	return h
}

func cmdArgs(ns, name string, stdin []byte) *skel.CmdArgs {
	return &skel.CmdArgs{
		ContainerID: "sandbox-1", Netns: "/var/run/netns/p", IfName: "eth0",
		Args:      "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=uid-" + name,
		StdinData: stdin,
	}
}

func TestAddForwardsToTheAgentAndReturnsPrevResultUnchanged(t *testing.T) {
	h := newHarness(&fakeAgent{}, nil)
	if err := h.p.Add(cmdArgs("mesh", "web", conf("1.0.0", prev100, ""))); err != nil {
		t.Fatalf("Add: %v", err)
	}
	if len(h.agent.adds) != 1 {
		t.Fatalf("agent saw %d adds", len(h.agent.adds))
	}
	req := h.agent.adds[0]
	want := &cniv1.Pod{Name: "web", Namespace: "mesh", Uid: "uid-web", ContainerId: "sandbox-1", Netns: "/var/run/netns/p", Interface: "eth0"}
	if req.GetPod().String() != want.String() || strings.Join(req.GetIps(), ",") != "198.18.0.5,fd00:198:18::5" {
		t.Errorf("request = %v", req)
	}
	c, _ := ParseConfig(conf("1.0.0", prev100, ""))
	var wantOut bytes.Buffer
	if err := c.PrevResult.PrintTo(&wantOut); err != nil {
		t.Fatal(err)
	}
	if h.out.String() != wantOut.String() {
		t.Errorf("stdout = %s, want prevResult %s", h.out, wantOut.String())
	}
}

func TestAddFailsClosed(t *testing.T) {
	unreachable := fmt.Errorf("%w: connection refused", events.ErrAgentUnreachable)
	timeout := fmt.Errorf("%w: context deadline exceeded", events.ErrAgentTimeout)
	cases := []struct {
		name      string
		agent     *fakeAgent       // nil: dial fails
		src       decide.PodSource // nil: no fallback
		ns, pod   string
		extra     string
		wantErr   string // substring; empty: the ADD succeeds
		wantAsked bool
	}{
		{name: "agent enrolls", agent: &fakeAgent{}, ns: "mesh", pod: "web", wantAsked: true},
		{name: "no ztunnel", agent: &fakeAgent{err: fmt.Errorf("%w: %w", events.ErrNotEnrolled, events.ErrNoZtunnel)}, src: testSource(),
			ns: "plain", pod: "web", wantErr: "no ztunnel connected", wantAsked: true},
		{name: "dataplane error", agent: &fakeAgent{err: fmt.Errorf("%w: attach tcx", events.ErrNotEnrolled)}, src: testSource(),
			ns: "mesh", pod: "web", wantErr: "agent could not enroll the pod: attach tcx", wantAsked: true},
		{name: "dial fails, ambient namespace", src: testSource(), ns: "mesh", pod: "web", wantErr: "agent unreachable"},
		{name: "unreachable, ambient namespace", agent: &fakeAgent{err: unreachable}, src: testSource(),
			ns: "mesh", pod: "web", wantErr: "agent unreachable: connection refused; the pod is ambient (namespace labelled ambient)", wantAsked: true},
		{name: "timeout, ambient pod label", agent: &fakeAgent{err: timeout}, src: testSource(),
			ns: "plain", pod: "amb", wantErr: "agent timed out", wantAsked: true},
		{name: "unreachable, plain pod passes", agent: &fakeAgent{err: unreachable}, src: testSource(), ns: "plain", pod: "web", wantAsked: true},
		{name: "timeout, opted-out pod passes", agent: &fakeAgent{err: timeout}, src: testSource(), ns: "mesh", pod: "optout", wantAsked: true},
		{name: "unreachable, api down", agent: &fakeAgent{err: unreachable}, src: &fakeSource{err: errors.New("connection refused")},
			ns: "plain", pod: "web", wantErr: "fallback: connection refused", wantAsked: true},
		{name: "unreachable, no fallback configured", agent: &fakeAgent{err: unreachable}, ns: "plain", pod: "web",
			wantErr: "no kubeconfig or pod file", wantAsked: true},
		{name: "unreachable, pod unknown to the fallback", agent: &fakeAgent{err: unreachable}, src: testSource(), ns: "plain", pod: "ghost",
			wantErr: "not found", wantAsked: true},
		{name: "excluded namespace never asks", ns: "kube-system", pod: "coredns"},
		{name: "configured excluded namespace", ns: "infra", pod: "x", extra: `,"excludeNamespaces":["infra"]`},
		{name: "agent's own pod never asks", ns: "ambient-ebpf", pod: "ambient-ebpf-node-x1",
			extra: `,"agentNamespace":"ambient-ebpf","agentPodPrefix":"ambient-ebpf-node-"`},
		{name: "not a kubernetes pod", ns: "", pod: ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(tc.agent, tc.src)
			err := h.p.Add(cmdArgs(tc.ns, tc.pod, conf("1.1.0", prev100, tc.extra)))
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("Add: %v", err)
				}
				if h.out.Len() == 0 {
					t.Error("no result printed")
				}
			} else {
				var cniErr *types.Error
				if !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater || !strings.Contains(cniErr.Msg, tc.wantErr) {
					t.Fatalf("Add error = %#v, want code 11 with %q", err, tc.wantErr)
				}
				if !strings.Contains(cniErr.Msg, tc.ns+"/"+tc.pod) {
					t.Errorf("error %q does not name the pod", cniErr.Msg)
				}
				if h.out.Len() != 0 {
					t.Errorf("failed ADD printed a result: %s", h.out)
				}
			}
			if asked := tc.agent != nil && len(tc.agent.adds) > 0; asked != tc.wantAsked {
				t.Errorf("agent asked = %v, want %v", asked, tc.wantAsked)
			}
		})
	}
}

func TestAddNeedsPrevResult(t *testing.T) {
	h := newHarness(&fakeAgent{}, nil)
	err := h.p.Add(cmdArgs("mesh", "web", conf("1.0.0", "", "")))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidNetworkConfig || !strings.Contains(cniErr.Msg, "prevResult") {
		t.Fatalf("Add without prevResult = %v", err)
	}
	if err := h.p.Check(cmdArgs("mesh", "web", conf("1.0.0", "", ""))); err == nil {
		t.Error("Check without prevResult succeeded")
	}
	if err := h.p.Check(cmdArgs("mesh", "web", conf("1.0.0", prev100, ""))); err != nil {
		t.Errorf("Check: %v", err)
	}
}

func TestDelNeverFailsBecauseOfTheAgent(t *testing.T) {
	for _, agent := range []*fakeAgent{nil, {err: events.ErrAgentUnreachable}, {err: events.ErrAgentTimeout}, {}} {
		h := newHarness(agent, nil)
		if err := h.p.Del(cmdArgs("mesh", "web", conf("1.0.0", "", ""))); err != nil {
			t.Errorf("Del with agent %+v: %v", agent, err)
		}
		if agent != nil && (len(agent.dels) != 1 || agent.dels[0].GetPod().GetUid() != "uid-web") {
			t.Errorf("agent dels = %v", agent.dels)
		}
	}
	h := newHarness(&fakeAgent{}, nil)
	if err := h.p.Del(cmdArgs("mesh", "web", []byte("{bad"))); err == nil {
		t.Error("Del accepted malformed stdin")
	}
}

func TestPanicBecomesCNIError(t *testing.T) {
	h := newHarness(&fakeAgent{}, nil)
	h.p.DialAgent = func(*Config) (Agent, error) { panic("boom") }
	err := h.p.Funcs().Add(cmdArgs("mesh", "web", conf("1.0.0", prev100, "")))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInternal || !strings.Contains(cniErr.Msg, "panicked: boom") {
		t.Fatalf("Add after panic = %v", err)
	}
}

func TestStatusAndGC(t *testing.T) {
	down := func(context.Context, *Config) error { return errors.New("connection refused") }
	cases := []struct {
		name  string
		probe func(context.Context, *Config) error
		extra string
		code  uint // 0: success
	}{
		{"agent up", func(context.Context, *Config) error { return nil }, "", 0},
		{"agent down, pod file fallback", down, `,"podFile":"/etc/pods.yaml"`, 0},
		{"agent down, kubeconfig fallback", down, `,"kubeconfig":"/etc/cni/net.d/k"`, 0},
		{"agent down, no fallback", down, "", types.ErrPluginNotAvailable},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(&fakeAgent{}, nil)
			h.p.ProbeAgent = tc.probe
			err := h.p.Status(&skel.CmdArgs{StdinData: conf("1.1.0", "", tc.extra)})
			var cniErr *types.Error
			switch {
			case tc.code == 0 && err != nil:
				t.Errorf("Status: %v", err)
			case tc.code != 0 && (!errors.As(err, &cniErr) || cniErr.Code != tc.code):
				t.Errorf("Status = %v, want code %d", err, tc.code)
			}
		})
	}
	h := newHarness(nil, nil)
	gc := []byte(`{"cniVersion":"1.1.0","name":"k8s","type":"ambient-ebpf-cni","cni.dev/valid-attachments":[{"containerID":"a","ifname":"eth0"}]}`)
	if err := h.p.GC(&skel.CmdArgs{StdinData: gc}); err != nil {
		t.Errorf("GC: %v", err)
	}
}

func TestProbeSocket(t *testing.T) {
	c := &Config{Settings: Settings{AgentSocket: filepath.Join(t.TempDir(), "missing.sock")}}
	if err := probeSocket(context.Background(), c); err == nil {
		t.Error("probe of a missing socket succeeded")
	}
}

// TestStatusOfAnAgentThatAcceptsButNeverAnswers: STATUS asks the agent
// with a deadline; accepting the connection is not being available.
func TestStatusOfAnAgentThatAcceptsButNeverAnswers(t *testing.T) {
	p := New(io.Discard, slog.New(slog.NewTextHandler(io.Discard, nil)))
	extra := fmt.Sprintf(`,"agentSocket":%q,"agentTimeout":"300ms"`, unixsocktest.Mute(t))
	start := time.Now()
	err := p.Status(&skel.CmdArgs{StdinData: conf("1.1.0", "", extra)})
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || cniErr.Code != types.ErrPluginNotAvailable || !strings.Contains(cniErr.Details, "agent timed out") {
		t.Errorf("Status = %v, want code %d (agent timed out)", err, types.ErrPluginNotAvailable)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("Status took %v with a 300ms agent timeout", took)
	}
}

// inProcessFallback decides as the fallback binary does, from the source
// sourceOf gives (nil: none configured), without the exec.
func inProcessFallback(sourceOf func(*Config) decide.PodSource) func(*Config, *cniv1.Pod) (Decision, error) {
	return func(conf *Config, pod *cniv1.Pod) (Decision, error) {
		src := sourceOf(conf)
		if src == nil {
			return Decision{}, errors.New("no kubeconfig or pod file configured to read the pod")
		}
		resp, err := decide.Decide(context.Background(), src, FallbackRequest(conf, pod))
		return Decision{Ambient: resp.Ambient, Reason: resp.Reason}, err
	}
}

// simnodeBuild builds a main package of this module into a temporary directory.
func simnodeBuild(t *testing.T, pkg string) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(pkg))
	if b, err := exec.Command("go", "build", "-o", out, pkg).CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v: %s", pkg, err, b)
	}
	return out
}

// slowAgent never answers before the caller's deadline.
type slowAgent struct{}

func (slowAgent) PodAdd(ctx context.Context, _ *cniv1.PodAddRequest) (events.AddResult, error) {
	<-ctx.Done()
	return events.AddResult{}, ctx.Err()
}

func (slowAgent) PodDel(ctx context.Context, _ *cniv1.PodDelRequest) error {
	<-ctx.Done()
	return ctx.Err()
}

func TestHungAgentTimesOutAndTheFallbackDecides(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "cni.sock")
	ln, err := events.Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- events.ServeListener(ctx, ln, slowAgent{}) }()
	defer func() { cancel(); <-served }()

	podFile := filepath.Join(dir, "pods.yaml")
	doc := "apiVersion: v1\nkind: Namespace\nmetadata: {name: mesh, labels: {istio.io/dataplane-mode: ambient}}\n---\n" +
		"apiVersion: v1\nkind: Namespace\nmetadata: {name: plain}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: mesh}\n---\n" +
		"apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: plain}\n"
	if err := os.WriteFile(podFile, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	extra := fmt.Sprintf(`,"agentSocket":%q,"agentTimeout":"300ms","podFile":%q`, sock, podFile)
	var out bytes.Buffer
	p := New(&out, slog.New(slog.NewTextHandler(io.Discard, nil)))
	// The real fallback binary, exec'd as on a node.
	p.FallbackBinary = simnodeBuild(t, "github.com/ambient-ebpf/ambient-ebpf/cmd/ambient-ebpf-cni-fallback")

	err = p.Add(cmdArgs("mesh", "web", conf("1.0.0", prev100, extra)))
	var cniErr *types.Error
	if !errors.As(err, &cniErr) || !strings.Contains(cniErr.Msg, "agent timed out") || !strings.Contains(cniErr.Msg, "the pod is ambient") {
		t.Errorf("ADD of an ambient pod with a hung agent = %v", err)
	}
	if err := p.Add(cmdArgs("plain", "web", conf("1.0.0", prev100, extra))); err != nil || out.Len() == 0 {
		t.Errorf("ADD of a plain pod with a hung agent = %v, output %q", err, out.String())
	}
	if err := p.Del(cmdArgs("mesh", "web", conf("1.0.0", "", extra))); err != nil {
		t.Errorf("DEL with a hung agent = %v", err)
	}
}

// An ADD naming an identity Kubernetes or Linux would refuse fails with CNI
// error 4 before anyone is asked; its DEL succeeds without reaching the
// agent (nothing was enrolled, and the primary CNI's DEL must still run).
func TestAddAndDelRefuseInvalidIdentities(t *testing.T) {
	cases := map[string]func(a *skel.CmdArgs){
		"traversal pod name": func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=../../links;K8S_POD_UID=u" },
		"traversal uid":      func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=web;K8S_POD_UID=../../links" },
		"nul in namespace":   func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAMESPACE=me\x00sh;K8S_POD_NAME=web" },
		"unicode pod name":   func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=wéb" },
		"overlong namespace": func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAMESPACE=" + strings.Repeat("m", 64) + ";K8S_POD_NAME=web" },
		"container id":       func(a *skel.CmdArgs) { a.ContainerID = "../../x" },
		"interface":          func(a *skel.CmdArgs) { a.IfName = "eth0/../lo" },
	}
	for name, edit := range cases {
		t.Run(name, func(t *testing.T) {
			agent := &fakeAgent{}
			h := newHarness(agent, testSource())
			add := cmdArgs("mesh", "web", conf("1.0.0", prev100, ""))
			edit(add)
			err := h.p.Add(add)
			var cniErr *types.Error
			if !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidEnvironmentVariables || !strings.HasPrefix(cniErr.Msg, "invalid ") {
				t.Errorf("Add = %v; want CNI error 4 naming the field", err)
			}
			del := cmdArgs("mesh", "web", conf("1.0.0", "", ""))
			edit(del)
			if err := h.p.Del(del); err != nil {
				t.Errorf("Del = %v; want success", err)
			}
			if h.dialed != 0 || len(agent.adds)+len(agent.dels) != 0 || h.out.Len() != 0 {
				t.Errorf("agent dialed %d times (adds %v, dels %v), output %q", h.dialed, agent.adds, agent.dels, h.out)
			}
		})
	}
}

// Whatever the runtime passes, ADD and DEL answer with nil or a CNI error,
// never panic, and what reaches the agent is a pod whose every identity
// passed pkg/validate's checks.
func FuzzAddDel(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=web;K8S_POD_UID=uid-web", "sandbox-1", "/var/run/netns/p", "eth0", conf("1.0.0", prev100, ""))
	f.Add("K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=../../links", "sandbox-1", "/var/run/netns/p", "eth0", conf("1.1.0", prev100, ""))
	f.Add("K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns", "c", "/n", "eth0", conf("0.3.1", `{"cniVersion":"0.3.1","ips":[{"version":"4","address":"198.18.0.7/24"}]}`, ""))
	f.Add("K8S_POD_NAMESPACE=mesh;K8S_POD_NAME=web", "c", "", "eth0", conf("1.0.0", "", ""))
	f.Add("", "", "", "", []byte("{"))
	f.Fuzz(func(t *testing.T, cniArgs, containerID, netns, ifName string, stdin []byte) {
		agent := &fakeAgent{}
		h := newHarness(agent, testSource())
		args := &skel.CmdArgs{Args: cniArgs, ContainerID: containerID, Netns: netns, IfName: ifName, StdinData: stdin}
		for cmd, run := range map[string]func(*skel.CmdArgs) error{"add": h.p.Add, "del": h.p.Del} {
			if err := run(args); err != nil {
				var cniErr *types.Error
				if !errors.As(err, &cniErr) {
					t.Fatalf("%s error %v (%T) is not a CNI error", cmd, err, err)
				}
			}
		}
		var pods []*cniv1.Pod
		for _, r := range agent.adds {
			pods = append(pods, r.GetPod())
		}
		for _, r := range agent.dels {
			pods = append(pods, r.GetPod())
		}
		for _, p := range pods {
			err := errors.Join(validate.PodNames(p.GetNamespace(), p.GetName()), validate.ContainerID(p.GetContainerId()), validate.Interface(p.GetInterface()))
			if p.GetUid() != "" {
				err = errors.Join(err, validate.PodUID(p.GetUid()))
			}
			if err != nil {
				t.Fatalf("the agent got pod %v: %v", p, err)
			}
		}
	})
}

// The plugin repeats enrollment's defaults and reasons so that it does not
// link the Kubernetes API types; they must not drift.
func TestRepeatedEnrollmentDefaultsMatch(t *testing.T) {
	if got, want := defaultExcludedNamespaces, enrollment.DefaultConfig().ExcludedNamespaces; !slices.Equal(got, want) {
		t.Errorf("excluded namespaces %v, enrollment has %v", got, want)
	}
	if reasonExcludedNS != string(enrollment.ReasonExcludedNS) || reasonSelf != string(enrollment.ReasonSelf) {
		t.Errorf("reasons %q, %q differ from enrollment's", reasonExcludedNS, reasonSelf)
	}
}
