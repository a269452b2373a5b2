// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agent wires the node agent together: a pod source (the
// Kubernetes API or the standalone pod file) and the CNI plugin feed one
// mesh, which drives the data path and hands pods to ztunnel over ZDS;
// around it the CNI installer, health and metrics.
//
// Start-up checks every socket path, the pod file and the listen addresses
// first, so a bad one fails before anything touches the kernel. Then it
// follows contract section 6: caches synced, snapshot built, data path
// adopted and reconciled, handlers started, ZDS served, then (with the CNI
// plugin's socket and the inspection socket listening too) ready. Every
// way out stops all servers first, so Run returns with their sockets gone.
// On shutdown everything stays in place (redirection keeps working while
// the agent restarts or upgrades) unless the agent is being uninstalled.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// source is a pod source the agent can drive and ask.
type source interface {
	kube.Source
	podSource
}

// Run runs the agent until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.setDefaults(); err != nil {
		return err
	}
	// Every path and address is checked before anything touches the
	// kernel, so a bad one leaves nothing behind.
	if err := cfg.validate(); err != nil {
		return err
	}
	a := &agent{cfg: cfg, log: cfg.Logger, metrics: newMetrics(cmp.Or(cfg.Repair.Mode, kube.RepairInPlace), cfg.PerPodMetrics)}
	return a.run(ctx)
}

type agent struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics

	client   kubernetes.Interface
	inst     *install.Installer
	serving  atomic.Bool
	features map[string]bool // kernel features of the data path, for the CLI
}

func (a *agent) ready() (bool, string) {
	if a.inst != nil && !a.inst.Ready() {
		return false, "CNI plugin not installed yet"
	}
	if !a.serving.Load() {
		return false, "starting"
	}
	return true, ""
}

func (a *agent) run(parent context.Context) error {
	srv, ctx := newServers(parent)
	defer srv.stop()
	log := a.log
	bi := buildinfo.Read()
	log.Info("agent starting", "version", bi.Version, "revision", bi.Revision, "modified", bi.Modified, "go", bi.GoVersion)

	// Liveness answers from the first moment; readiness waits for the end.
	healthDone, err := serveHTTP(ctx, a.cfg.HealthAddr, healthHandler(a.ready), log)
	if err != nil {
		return fmt.Errorf("health server: %w", err)
	}
	srv.watch("health server", healthDone)
	metricsDone, err := serveHTTP(ctx, a.cfg.MetricsAddr, promhttp.HandlerFor(a.metrics.reg, promhttp.HandlerOpts{}), log)
	if err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	srv.watch("metrics server", metricsDone)

	if a.cfg.Install != nil {
		ic := *a.cfg.Install
		ic.OnResult = func(result string) { a.metrics.installs.WithLabelValues(result).Inc() }
		a.inst = install.New(ic)
		srv.background(func() { a.runInstaller(ctx) })
	}

	kcfg := kube.Config{NodeName: a.cfg.NodeName, Enrollment: a.cfg.Enrollment, Repair: a.cfg.Repair, Logger: log.With("component", "kube"),
		OnEvent:  func(_, typ string) { a.metrics.reconcile.WithLabelValues(typ).Inc() },
		OnRepair: func(mode, result string) { a.metrics.repaired.WithLabelValues(mode, result).Inc() }}
	m := newMesh(nil, nil, podnetns.New(a.cfg.ProcRoot), a.cfg.Enrollment, log.With("component", "mesh"), a.metrics)
	zsrv, err := zds.NewServer(zds.Config{SocketPath: a.cfg.ZDSSocket, Snapshot: m.snapshot, Logger: log.With("component", "zds")})
	if err != nil {
		return err
	}
	m.zt = zsrv
	src, err := a.newSource(kcfg, m)
	if err != nil {
		return err
	}

	// 1. Caches synced.
	if err := src.Start(ctx); err != nil {
		return fmt.Errorf("sync pod caches: %w", err)
	}
	// 2. Snapshot: the pods annotated as redirected on this node.
	snap, err := src.Snapshot()
	if err != nil {
		return fmt.Errorf("build snapshot: %w", err)
	}
	// 3. Data path: adopt what is pinned, then reconcile it with the snapshot.
	features.Log(log)
	a.features = map[string]bool{}
	for _, f := range features.Report() {
		a.features[f.Name] = f.Available
	}
	dp, err := dataplane.New(a.cfg.Dataplane)
	if err != nil {
		return fmt.Errorf("load data path: %w", err)
	}
	// From here every way out stops the servers (which use the data path)
	// before the data path is kept or removed.
	stop := func(err error) error {
		srv.stop()
		return a.shutdown(dp, err)
	}
	m.dp = dp
	a.metrics.bpf.setSource(dp)
	a.metrics.decisions.setSource(dp)
	m.setSource(src)
	a.reconcileAtStart(ctx, m, src, snap)

	// 4. Handlers.
	srv.run("pod source", func() error { return src.Run(ctx) })
	// 5. ZDS, the CNI plugin's channel and the inspection API, each
	// listening before the agent says it is ready.
	srv.run("zds server", func() error { return zsrv.Run(ctx) })
	select {
	case <-zsrv.Ready():
	case err := <-srv.stopped():
		return stop(err)
	case <-ctx.Done():
		return stop(nil)
	}
	cniLn, err := events.Listen(a.cfg.CNISocket)
	if err != nil {
		return stop(fmt.Errorf("cni socket: %w", err))
	}
	srv.run("cni event server", func() error {
		return events.ServeListener(ctx, cniLn, m, events.WithObserver(a.metrics.observeCNI))
	})
	srv.background(func() { a.watchZtunnel(ctx, m) })
	hub := newTraceHub(a.cfg.Dataplane.BPFFSDir, a.cfg.TraceHistory, log.With("component", "trace"))
	srv.background(func() { hub.run(ctx) })
	inspectDone, err := serveInspect(ctx, a.cfg.InspectSocket, &inspector{a: a, m: m, trace: hub}, log.With("component", "inspect"))
	if err != nil {
		return stop(err)
	}
	srv.watch("inspection server", inspectDone)
	// 6. Ready: every listener is up.
	a.serving.Store(true)
	log.Info("agent ready", "node", a.cfg.NodeName, "enrolled", m.count(), "zds", a.cfg.ZDSSocket, "cni", a.cfg.CNISocket)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-srv.stopped():
	}
	a.serving.Store(false)
	return stop(runErr)
}

func (a *agent) newSource(kcfg kube.Config, m *mesh) (source, error) {
	if a.cfg.StandalonePods != "" {
		return kube.NewFileSource(kcfg, a.cfg.StandalonePods, m)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", a.cfg.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client config: %w", err)
	}
	a.client, err = kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client: %w", err)
	}
	return kube.New(kcfg, a.client, m)
}

func (a *agent) runInstaller(ctx context.Context) {
	for {
		err := a.inst.Run(ctx)
		if ctx.Err() != nil {
			return
		}
		a.log.Error("cni install failed; retrying", "error", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Second):
		}
	}
}

// watchZtunnel keeps the gauges current and promotes pending pods once
// ztunnel is there.
func (a *agent) watchZtunnel(ctx context.Context, m *mesh) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		a.metrics.ztunnel.Set(float64(m.zt.Connections()))
		if a.inst != nil {
			a.metrics.installReady.Set(boolFloat(a.inst.Ready()))
		}
		m.retryPending(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// reconcileAtStart makes the adopted data path match the pods: snapshot
// pods are (re-)enrolled where their netns can be found, adopted pods that
// are gone or no longer ambient are removed, and the rest are kept.
func (a *agent) reconcileAtStart(ctx context.Context, m *mesh, src podSource, snap []*corev1.Pod) {
	adopted := map[string]dataplane.EnrolledPod{}
	for _, p := range m.dp.List() {
		adopted[p.UID] = p
	}
	// One scan of /proc for every pod: a scan per pod made a restart with
	// a thousand pods quadratic.
	uids := make([]types.UID, 0, len(snap)+len(adopted))
	for _, pod := range snap {
		uids = append(uids, pod.UID)
	}
	for uid := range adopted {
		uids = append(uids, types.UID(uid))
	}
	netnsOf, err := m.netns.FindAll(uids)
	if err != nil {
		a.log.Warn("scan for pods' netns failed", "error", err)
		netnsOf = map[types.UID]podnetns.NetNS{}
	}
	seen := map[string]bool{}
	for _, pod := range snap {
		uid := string(pod.UID)
		seen[uid] = true
		mb := &member{uid: uid, namespace: pod.Namespace, name: pod.Name, serviceAccount: pod.Spec.ServiceAccountName, state: kube.RedirectionEnabled}
		ns, ok := netnsOf[pod.UID]
		if !ok {
			err := fmt.Errorf("pod uid %s: %w", pod.UID, podnetns.ErrNotFound)
			if _, ok := adopted[uid]; !ok {
				a.log.Warn("snapshot pod has no netns and no pinned state; left to repair", "pod", pod.Namespace+"/"+pod.Name, "error", err)
				continue
			}
			m.keep(mb) // keep the pins; ztunnel gets a Keep
			continue
		}
		mb.netns = ns.Path
		// Re-applied in place; its state stays enabled: ztunnel had it
		// and gets it again in the snapshot of its next connection, so
		// the annotation does not flap through pending on a restart.
		d := enrollment.Decide(a.cfg.Enrollment, pod, nil)
		if err := enroll(ctx, m.dp, dataplane.Pod{UID: uid, Namespace: pod.Namespace, Name: pod.Name, Netns: mb.netns,
			IPs: podIPs(pod), Options: dpOptions(d.Options)}); err != nil {
			a.log.Error("re-enrolling snapshot pod failed", "pod", pod.Namespace+"/"+pod.Name, "error", err)
			if _, ok := adopted[uid]; !ok {
				continue
			}
		}
		m.keep(mb)
	}
	for uid, p := range adopted {
		if seen[uid] {
			continue
		}
		key := p.Namespace + "/" + p.Name
		pod, ns, err := src.Lookup(ctx, p.Namespace, p.Name)
		if err == nil && string(pod.UID) == uid && enrollment.Decide(a.cfg.Enrollment, pod, ns).Ambient {
			mb := &member{uid: uid, namespace: p.Namespace, name: p.Name, serviceAccount: pod.Spec.ServiceAccountName, state: kube.RedirectionEnabled}
			if found, ok := netnsOf[types.UID(uid)]; ok {
				mb.netns = found.Path
			}
			m.keep(mb)
			src.Requeue(p.Namespace, p.Name)
			continue
		}
		a.log.Info("removing adopted pod that left", "pod", key, "uid", uid)
		a.metrics.bpf.retire(uid)
		if err := m.dp.Remove(ctx, uid); err != nil {
			a.log.Error("removing adopted pod failed", "pod", key, "error", err)
		}
	}
	a.metrics.enrolled.Set(float64(m.count()))
}

// shutdown keeps or removes the node state, then reports runErr.
func (a *agent) shutdown(dp *dataplane.Dataplane, runErr error) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if a.uninstalling(ctx) {
		a.log.Info("uninstalling: removing the CNI plugin and all data path state")
		var errs []error
		if a.inst != nil {
			errs = append(errs, a.inst.Cleanup())
		}
		errs = append(errs, dp.Uninstall())
		return errors.Join(append([]error{runErr}, errs...)...)
	}
	a.log.Info("stopping; redirection stays in place for the next agent")
	return errors.Join(runErr, dp.Close())
}

// uninstalling tells an uninstall from a restart or upgrade: the agent's
// DaemonSet is gone or being deleted.
func (a *agent) uninstalling(ctx context.Context) bool {
	if a.cfg.UninstallOnExit {
		return true
	}
	if a.client == nil || a.cfg.DaemonSetName == "" {
		return false
	}
	ds, err := a.client.AppsV1().DaemonSets(a.cfg.DaemonSetNamespace).Get(ctx, a.cfg.DaemonSetName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true
	case err != nil:
		a.log.Warn("cannot tell uninstall from upgrade; keeping state", "error", err)
		return false
	}
	return ds.DeletionTimestamp != nil
}
