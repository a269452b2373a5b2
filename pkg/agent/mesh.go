// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/identity"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// The parts the mesh drives, as interfaces so tests can fake them.
type (
	dataplaneAPI interface {
		Enroll(ctx context.Context, pod dataplane.Pod) error
		Remove(ctx context.Context, uid string) error
		List() []dataplane.EnrolledPod
	}
	ztunnelAPI interface {
		AddWorkload(ctx context.Context, w zds.Workload) error
		DelWorkload(ctx context.Context, uid string) error
		Connections() int
	}
	podSource interface {
		Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error)
		Requeue(namespace, name string)
	}
	netnsFinder interface {
		Find(uid types.UID) (podnetns.NetNS, error)
		FindAll(uids []types.UID) (map[types.UID]podnetns.NetNS, error)
		Same(a, b string) (same, known bool)
	}
)

// member is a pod in the mesh as the agent knows it.
type member struct {
	uid            string
	namespace      string
	name           string
	serviceAccount string
	netns          string // path; "" when not known (adopted, not found yet)
	containerID    string // the sandbox of the CNI ADD; "" for pods enrolled live or adopted
	state          kube.Redirection
}

func (m *member) workload() zds.Workload {
	return zds.Workload{UID: m.uid, Name: m.name, Namespace: m.namespace, ServiceAccount: m.serviceAccount, Netns: m.netns}
}

// mesh puts pods in and out of the mesh: the dataplane first, then ztunnel.
// It is the kube.Mesh of the controllers and the events.Handler of the CNI
// plugin, so both paths share one state.
type mesh struct {
	dp      dataplaneAPI
	zt      ztunnelAPI
	netns   netnsFinder
	enroll  enrollment.Config
	log     *slog.Logger
	metrics *metrics

	mu      sync.Mutex
	members map[string]*member
	source  podSource // set once the source exists
}

func newMesh(dp dataplaneAPI, zt ztunnelAPI, finder netnsFinder, cfg enrollment.Config, log *slog.Logger, m *metrics) *mesh {
	return &mesh{dp: dp, zt: zt, netns: finder, enroll: cfg, log: log, metrics: m, members: map[string]*member{}}
}

func (m *mesh) setSource(s podSource) {
	m.mu.Lock()
	m.source = s
	m.mu.Unlock()
}

// snapshot is what every new ztunnel connection receives (Z2).
func (m *mesh) snapshot() []zds.Workload {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]zds.Workload, 0, len(m.members))
	for _, mb := range m.members {
		out = append(out, mb.workload())
	}
	return out
}

func (m *mesh) member(uid string) *member {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.members[uid]
}

func podIPs(pod *corev1.Pod) []netip.Addr {
	var ips []netip.Addr
	for _, p := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(p.IP); err == nil {
			ips = append(ips, a)
		}
	}
	if len(ips) == 0 {
		if a, err := netip.ParseAddr(pod.Status.PodIP); err == nil {
			ips = append(ips, a)
		}
	}
	return ips
}

func dpOptions(o enrollment.Options) dataplane.Options {
	return dataplane.Options{BypassInbound: o.BypassInbound, DNSCapture: o.DNSCapture, RerouteInterfaces: o.RerouteInterfaces}
}

// add enrolls in the dataplane, then hands the pod to ztunnel. With no
// ztunnel connected the pod stays redirected and pending: ztunnel gets it
// in its snapshot when it connects (strict, for the CNI path, undoes it).
func (m *mesh) add(ctx context.Context, mb *member, ips []netip.Addr, iface string, opts enrollment.Options, strict bool) error {
	start := time.Now()
	key := mb.namespace + "/" + mb.name
	err := enroll(ctx, m.dp, dataplane.Pod{UID: mb.uid, Namespace: mb.namespace, Name: mb.name, Netns: mb.netns,
		Interface: iface, IPs: ips, Options: dpOptions(opts)})
	if err != nil {
		m.metrics.dataplaneErrors.WithLabelValues("enroll").Inc()
		return fmt.Errorf("enroll pod %s in the dataplane: %w", key, err)
	}
	mb.state = kube.RedirectionPending
	m.mu.Lock()
	m.members[mb.uid] = mb
	m.mu.Unlock()

	zerr := m.zt.AddWorkload(ctx, mb.workload())
	switch {
	case zerr == nil:
		m.setState(mb.uid, kube.RedirectionEnabled)
	case strict:
		m.forget(mb.uid)
		if rerr := m.dp.Remove(context.WithoutCancel(ctx), mb.uid); rerr != nil {
			m.log.Error("undo enrollment failed", "pod", key, "error", rerr)
		}
		if errors.Is(zerr, zds.ErrNoZtunnel) {
			return fmt.Errorf("pod %s: %w", key, errors.Join(events.ErrNoZtunnel, zerr))
		}
		return fmt.Errorf("hand pod %s to ztunnel: %w", key, zerr)
	default:
		m.log.Warn("pod redirected, ztunnel does not have it yet", "pod", key, "error", zerr)
	}
	m.metrics.enrollSeconds.Observe(time.Since(start).Seconds())
	m.metrics.enrolled.Set(float64(m.count()))
	return nil
}

// enroll checks what names the pod's pins and interfaces (pkg/identity),
// then enrolls it: the last check before a string from outside reaches a
// path. Every path into the dataplane goes through it.
func enroll(ctx context.Context, dp dataplaneAPI, p dataplane.Pod) error {
	checks := []error{identity.Pod(p.Namespace, p.Name, p.UID)}
	if p.Interface != "" {
		checks = append(checks, identity.Interface(p.Interface))
	}
	for _, v := range p.Options.RerouteInterfaces {
		if err := identity.Interface(v); err != nil {
			checks = append(checks, fmt.Errorf("annotation %s: %w", enrollment.RerouteInterfacesAnnotation, err))
		}
	}
	if err := errors.Join(checks...); err != nil {
		return err
	}
	return dp.Enroll(ctx, p)
}

func (m *mesh) setState(uid string, s kube.Redirection) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if mb := m.members[uid]; mb != nil {
		mb.state = s
	}
}

// keep records a pod the data path already redirects.
func (m *mesh) keep(mb *member) {
	m.mu.Lock()
	m.members[mb.uid] = mb
	m.mu.Unlock()
}

func (m *mesh) forget(uid string) {
	m.mu.Lock()
	delete(m.members, uid)
	m.mu.Unlock()
}

func (m *mesh) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.members)
}

// remove takes the pod out of the dataplane and tells every ztunnel.
func (m *mesh) remove(ctx context.Context, uid, key string) error {
	start := time.Now()
	m.forget(uid)
	m.metrics.bpf.retire(uid)
	err := m.dp.Remove(ctx, uid)
	if err != nil {
		m.metrics.dataplaneErrors.WithLabelValues("remove").Inc()
		err = fmt.Errorf("remove pod %s from the dataplane: %w", key, err)
	}
	if zerr := m.zt.DelWorkload(ctx, uid); zerr != nil {
		// ztunnel drops pods missing from its next snapshot anyway.
		m.log.Warn("ztunnel did not take the removal", "pod", key, "error", zerr)
	}
	m.metrics.removeSeconds.Observe(time.Since(start).Seconds())
	m.metrics.enrolled.Set(float64(m.count()))
	return err
}

// AddPodToMesh redirects a running pod in place (kube.Mesh).
func (m *mesh) AddPodToMesh(ctx context.Context, pod *corev1.Pod, opts enrollment.Options) error {
	uid := string(pod.UID)
	mb := &member{uid: uid, namespace: pod.Namespace, name: pod.Name, serviceAccount: pod.Spec.ServiceAccountName}
	old := m.member(uid)
	if old != nil {
		mb.containerID = old.containerID
	}
	if old != nil && old.netns != "" {
		mb.netns = old.netns
	} else {
		ns, err := m.netns.Find(pod.UID)
		if err != nil {
			return fmt.Errorf("find netns of pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
		mb.netns = ns.Path
	}
	return m.add(ctx, mb, podIPs(pod), "", opts, false)
}

// RemovePodFromMesh removes a pod (kube.Mesh).
func (m *mesh) RemovePodFromMesh(ctx context.Context, pod *corev1.Pod) error {
	return m.remove(ctx, string(pod.UID), pod.Namespace+"/"+pod.Name)
}

// Redirection reports a pod's state (kube.Mesh).
func (m *mesh) Redirection(uid types.UID) kube.Redirection {
	if mb := m.member(string(uid)); mb != nil {
		return mb.state
	}
	return kube.RedirectionNone
}

// PodAdd enrolls a new pod for the CNI plugin, before its app starts. It
// fails whenever an ambient pod could not be fully enrolled: fail closed.
func (m *mesh) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (events.AddResult, error) {
	p := req.GetPod()
	key := p.GetNamespace() + "/" + p.GetName()
	m.mu.Lock()
	src := m.source
	m.mu.Unlock()
	if src == nil {
		return events.AddResult{}, fmt.Errorf("pod %s: the agent is starting", key)
	}
	pod, ns, err := src.Lookup(ctx, p.GetNamespace(), p.GetName())
	if err != nil {
		return events.AddResult{}, err
	}
	if p.GetUid() != "" && pod.UID != "" && string(pod.UID) != p.GetUid() {
		return events.AddResult{}, fmt.Errorf("pod %s: the runtime names uid %s, the API %s", key, p.GetUid(), pod.UID)
	}
	d := enrollment.Decide(m.enroll, pod, ns)
	if !d.Ambient {
		return events.AddResult{Reason: string(d.Reason)}, nil
	}
	uid := p.GetUid()
	if uid == "" {
		uid = string(pod.UID)
	}
	var ips []netip.Addr
	for _, s := range req.GetIps() {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return events.AddResult{}, fmt.Errorf("pod %s: bad IP %q from the runtime: %w", key, s, err)
		}
		ips = append(ips, a)
	}
	mb := &member{uid: uid, namespace: pod.Namespace, name: pod.Name, serviceAccount: pod.Spec.ServiceAccountName,
		netns: p.GetNetns(), containerID: p.GetContainerId()}
	if err := m.add(ctx, mb, ips, p.GetInterface(), d.Options, true); err != nil {
		return events.AddResult{}, err
	}
	src.Requeue(pod.Namespace, pod.Name) // the annotation follows
	return events.AddResult{Enrolled: true, Reason: string(d.Reason)}, nil
}

// PodDel removes a pod whose sandbox goes away. Without K8S_POD_UID (not
// every runtime passes it) the pod is found among the members (delTarget).
// A DEL about an older sandbox of a pod, or that matches no member, removes
// nothing.
func (m *mesh) PodDel(ctx context.Context, req *cniv1.PodDelRequest) error {
	p := req.GetPod()
	key := p.GetNamespace() + "/" + p.GetName()
	var err error
	if uid := m.delTarget(p); uid != "" {
		err = m.remove(ctx, uid, key)
	} else {
		m.log.Info("cni del matches no enrolled pod", "pod", key, "uid", p.GetUid(), "container", p.GetContainerId(), "netns", p.GetNetns())
	}
	return err
}

// delTarget returns the uid of the pod a DEL is about, or "". With a uid it
// is that pod, unless it was enrolled from another sandbox (a late or
// repeated DEL of a sandbox it replaced). Without one it is the member
// delMatch ranks best, when exactly one is; a tie removes nothing.
func (m *mesh) delTarget(p *cniv1.Pod) string {
	m.mu.Lock()
	defer m.mu.Unlock()
	if uid := p.GetUid(); uid != "" {
		if mb := m.members[uid]; mb != nil && differ(mb.containerID, p.GetContainerId()) {
			return ""
		}
		return uid
	}
	best, bestRank, ties := "", 0, 0
	for uid, mb := range m.members {
		switch r := m.delMatch(mb, p); {
		case r > bestRank:
			best, bestRank, ties = uid, r, 1
		case r == bestRank && r > 0:
			ties++
		}
	}
	if ties != 1 {
		return ""
	}
	return best
}

// delMatch ranks how surely member mb is the pod a DEL without uid names:
// 3 the same sandbox (container id), 2 the same netns, 1 the same namespace
// and name, 0 nothing in common or a contradiction (another sandbox, netns
// or name than the member is known by).
func (m *mesh) delMatch(mb *member, p *cniv1.Pod) int {
	if differ(mb.containerID, p.GetContainerId()) || differ(mb.namespace, p.GetNamespace()) || differ(mb.name, p.GetName()) {
		return 0
	}
	if mb.containerID != "" && mb.containerID == p.GetContainerId() {
		return 3
	}
	if mb.netns != "" && p.GetNetns() != "" {
		if same, known := m.netns.Same(mb.netns, p.GetNetns()); same {
			return 2
		} else if known {
			return 0
		}
	}
	if p.GetNamespace() != "" && p.GetName() != "" {
		return 1 // the names agree: differ passed them
	}
	return 0
}

// differ reports whether a field known on both sides holds different values.
func differ(known, given string) bool { return known != "" && given != "" && known != given }

// retryPending hands pending pods to ztunnel once one is connected, and
// requeues them so their annotation turns enabled.
func (m *mesh) retryPending(ctx context.Context) {
	if m.zt.Connections() == 0 {
		return
	}
	m.mu.Lock()
	var pending []*member
	for _, mb := range m.members {
		if mb.state == kube.RedirectionPending {
			c := *mb
			pending = append(pending, &c)
		}
	}
	src := m.source
	m.mu.Unlock()
	for _, mb := range pending {
		if err := m.zt.AddWorkload(ctx, mb.workload()); err != nil {
			m.log.Warn("ztunnel did not take a pending pod", "pod", mb.namespace+"/"+mb.name, "error", err)
			continue
		}
		m.setState(mb.uid, kube.RedirectionEnabled)
		if src != nil {
			src.Requeue(mb.namespace, mb.name)
		}
	}
}
