// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package node

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/ambient-ebpf/ambient-ebpf/test/sockutil"
	"github.com/ambient-ebpf/ambient-ebpf/test/ztunnel/standin"
)

// sample is one connection the sampler made to a pod's echo server and
// what the server answered.
type sample struct {
	At     time.Time
	From   string // "node", or the client pod's name
	Target string // the pod dialled
	Dst    netip.AddrPort
	Local  string // the client socket's address
	Server string // the pod that answered
	Peer   string // the client as the answering app saw it
	Err    string
}

// via reports whether the connection reached the app through ztunnel: its
// relay dials the app from a socket of its own (the client's address kept,
// IP_TRANSPARENT, another port), so the app's peer is not the client's
// socket.
func (s sample) via() bool { return s.Server != "" && s.Peer != s.Local }

// sampler dials every target pod's echo server every 100 ms, from the
// node netns and from a client pod's netns, for as long as it runs: across
// reboots, restarts and crash loops, whatever answers. The node's samples
// come from the test's own process, outside the node's cgroup: to the
// agent's socket hooks they are traffic arriving from beyond the node, not
// a local socket of the node (a kubelet probe, contract H1, which goes
// around ztunnel by design).
type sampler struct {
	s       *scene
	targets []*corev1.Pod // by namespace and name
	client  *corev1.Pod
	// runtime is the sampler's own CRI client: the node's is replaced
	// when containerd starts again.
	runtime cri.RuntimeServiceClient

	mu      sync.Mutex
	samples []sample
	stop    chan struct{}
	done    chan struct{}
}

func (s *scene) startSampler(client *corev1.Pod, targets ...*corev1.Pod) *sampler {
	conn, err := grpc.NewClient("unix://"+s.n.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		s.t.Fatal(err)
	}
	sp := &sampler{s: s, targets: targets, client: client, runtime: cri.NewRuntimeServiceClient(conn),
		stop: make(chan struct{}), done: make(chan struct{})}
	go sp.run()
	s.t.Cleanup(func() { sp.Stop(); conn.Close() })
	return sp
}

// Stop ends the sampling; it is idempotent.
func (sp *sampler) Stop() {
	select {
	case <-sp.stop:
	default:
		close(sp.stop)
	}
	<-sp.done
}

func (sp *sampler) run() {
	defer close(sp.done)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-sp.stop:
			return
		case <-tick.C:
		}
		sp.round()
	}
}

// round dials each target once from the node and once from the client
// pod (when its sandbox is ready), in parallel.
func (sp *sampler) round() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	dsts := map[string]netip.AddrPort{}
	for _, p := range sp.targets {
		got, err := cluster.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			continue
		}
		if ip, err := netip.ParseAddr(got.Status.PodIP); err == nil {
			dsts[p.Name] = netip.AddrPortFrom(ip, 8080)
		}
	}
	var wg sync.WaitGroup
	dial := func(ns *sockutil.Netns, from, target string, dst netip.AddrPort) {
		defer wg.Done()
		smp := dialEcho(ns, dst)
		smp.From, smp.Target = from, target
		sp.mu.Lock()
		sp.samples = append(sp.samples, smp)
		sp.mu.Unlock()
	}
	for name, dst := range dsts {
		wg.Add(1)
		go dial(sp.s.n.NodeSockets(), "node", name, dst)
	}
	if ns := sp.clientNetns(ctx); ns != nil {
		defer ns.Close()
		for name, dst := range dsts {
			if name != sp.client.Name {
				wg.Add(1)
				go dial(ns, sp.client.Name, name, dst)
			}
		}
	}
	wg.Wait()
}

// clientNetns enters the netns of the client pod's ready sandbox, or
// returns nil when there is none (the runtime down, the pod not started).
func (sp *sampler) clientNetns(ctx context.Context) *sockutil.Netns {
	list, err := sp.runtime.ListPodSandbox(ctx, &cri.ListPodSandboxRequest{Filter: &cri.PodSandboxFilter{
		State:         &cri.PodSandboxStateValue{State: cri.PodSandboxState_SANDBOX_READY},
		LabelSelector: map[string]string{"io.kubernetes.pod.namespace": sp.client.Namespace, "io.kubernetes.pod.name": sp.client.Name},
	}})
	if err != nil || len(list.Items) != 1 {
		return nil
	}
	st, err := sp.runtime.PodSandboxStatus(ctx, &cri.PodSandboxStatusRequest{PodSandboxId: list.Items[0].Id, Verbose: true})
	if err != nil {
		return nil
	}
	path := sandboxNetns(st.Info["info"])
	if path == "" {
		return nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	ns, err := sockutil.EnterNetns(f)
	if err != nil {
		return nil
	}
	return ns
}

// dialEcho makes one connection to an echo server and reads its first
// line: who answered and the peer it saw.
func dialEcho(ns *sockutil.Netns, dst netip.AddrPort) sample {
	smp := sample{At: time.Now(), Dst: dst}
	c, err := ns.Dial(dst, sockutil.Opts{}, time.Second)
	if err != nil {
		smp.Err = err.Error()
		return smp
	}
	defer c.Close()
	smp.Local = c.LocalAddr().String()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		smp.Err = fmt.Sprintf("read the reply: %v", err)
		return smp
	}
	var r struct{ Server, Peer string }
	if err := json.Unmarshal(line, &r); err != nil {
		smp.Err = fmt.Sprintf("decode the reply %q: %v", line, err)
		return smp
	}
	smp.Server, smp.Peer = r.Server, r.Peer
	return smp
}

// since returns the samples taken at or after t.
func (sp *sampler) since(t time.Time) []sample {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	var out []sample
	for _, s := range sp.samples {
		if !s.At.Before(t) {
			out = append(out, s)
		}
	}
	return out
}

// verdict judges samples against the ztunnel stand-ins' records: an
// answer from a pod in ambient that did not pass ztunnel is a bypass; an
// answer from a pod outside the mesh that did is a capture.
type verdict struct {
	Samples, Answered, Failed int
	Bypass, Captured          []sample
	Errors                    map[string]int // failed samples by client, target and error
}

func judge(samples []sample, records []standin.Record, ambient map[string]bool) verdict {
	// A client address is used again within seconds (ephemeral ports),
	// and at once towards another destination (the kernel shares a
	// source port between connections to different peers): a record
	// names a sample only when its client and original destination are
	// the sample's and they are close in time.
	flow := func(client, dst string) string { return client + " > " + dst }
	inbound := map[string][]time.Time{}
	for _, r := range records {
		if r.Listener == standin.InboundPort {
			k := flow(r.Peer.String(), r.OrigDst.String())
			inbound[k] = append(inbound[k], r.Time)
		}
	}
	recorded := func(s sample) bool {
		for _, at := range inbound[flow(s.Local, s.Dst.String())] {
			if d := at.Sub(s.At); d > -2*time.Second && d < 2*time.Second {
				return true
			}
		}
		return false
	}
	v := verdict{Errors: map[string]int{}}
	for _, s := range samples {
		v.Samples++
		if s.Server == "" {
			v.Failed++
			reason := s.Err
			if i := strings.LastIndex(reason, ": "); i >= 0 {
				reason = reason[i+2:]
			}
			v.Errors[s.From+" -> "+s.Target+": "+reason]++
			continue
		}
		v.Answered++
		through := s.via() || recorded(s)
		switch {
		case ambient[s.Server] && !through:
			v.Bypass = append(v.Bypass, s)
		case !ambient[s.Server] && through:
			v.Captured = append(v.Captured, s)
		}
	}
	return v
}

func (v verdict) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d samples, %d answered, %d not (refused, reset or timed out), %d bypassed ztunnel, %d captured",
		v.Samples, v.Answered, v.Failed, len(v.Bypass), len(v.Captured))
	if len(v.Errors) > 0 {
		fmt.Fprintf(&b, "; not answered: %v", v.Errors)
	}
	for i, s := range append(v.Bypass, v.Captured...) {
		if i == 5 {
			b.WriteString("\n  ...")
			break
		}
		fmt.Fprintf(&b, "\n  %s %s -> %s (%s): answered by %s, which saw %s", s.At.Format("15:04:05.000"), s.From, s.Target, s.Dst, s.Server, s.Peer)
	}
	return b.String()
}
