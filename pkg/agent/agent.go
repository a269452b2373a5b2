// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package agent wires the node agent together: a pod source (the
// Kubernetes API or the standalone pod file) and the CNI plugin report to
// one reconciler (pkg/reconciler), which drives the data path and hands
// pods to ztunnel over ZDS, whose acks come back to it as events; the
// status writer (pkg/kube, or the pod file's in-memory one) and the
// metrics listen to its changes. Around it the CNI installer, health and
// metrics.
//
// Start-up checks every socket path, the pod file and the listen addresses
// first, so a bad one fails before anything touches the kernel. Then it
// follows contract section 6: caches synced, snapshot built, data path
// adopted and reconciled, handlers started, ZDS served, then (with the CNI
// plugin's socket and the inspection socket listening too) ready. Every
// way out stops all servers first, so Run returns with their sockets gone.
// On shutdown everything stays in place (redirection keeps working while
// the agent restarts or upgrades) unless the agent is being uninstalled.
// The stop is bounded whatever the reconciler has queued: the servers are
// told to stop (no queued pod starts), the uninstall is decided while they
// do, the queue is given up (the next start reconciles every pod again),
// then the data path is kept or removed.
package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-ebpf/ambient-ebpf/internal/buildinfo"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/events"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/install"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/features"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podnetns"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/standalone"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/takeover"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/zds"
)

// source is a pod source the agent drives: it reports to the reconciler
// and reads a pod for a CNI ADD.
type source interface {
	Start(ctx context.Context) error
	Snapshot() ([]*corev1.Pod, error)
	Run(ctx context.Context, sink reconciler.Desired) error
	Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error)
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
	zt       *zds.Server
	serving  atomic.Bool
	features map[string]bool // kernel features of the data path, for the CLI

	istio    *istiocni.RuleManager  // nil: neither takeover nor hand-back
	takeover *takeover.Takeover     // nil: no takeover
	rec      *reconciler.Reconciler // set once the data path is loaded
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
	if err := a.checkFileLimit(); err != nil {
		return err
	}

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

	kcfg := kube.Config{NodeName: a.cfg.NodeName, Repair: a.cfg.Repair, Logger: log.With("component", "kube"),
		OnEvent:  func(_, typ string) { a.metrics.reconcile.WithLabelValues(typ).Inc() },
		OnRepair: func(mode, result string) { a.metrics.repaired.WithLabelValues(mode, result).Inc() }}
	// ZDS and the reconciler need each other: the reconciler hands pods
	// to ztunnel, ztunnel's acks and snapshots come back to it. The
	// server runs (step 5) only once the reconciler exists.
	var rec *reconciler.Reconciler
	var dp *dataplane.Dataplane
	zsrv, err := zds.NewServer(zds.Config{SocketPath: a.cfg.ZDSSocket, Logger: log.With("component", "zds"),
		Snapshot:      func() []zds.Workload { return rec.Snapshot() },
		OnHello:       func(p zds.Peer) error { return a.attachZtunnel(dp, p) },
		OnAck:         func(ack zds.Ack) { rec.OnAck(ack) },
		OnConnections: func(n int) { a.metrics.ztunnel.Set(float64(n)) }})
	if err != nil {
		return err
	}
	a.zt = zsrv
	src, listen, err := a.newSource(kcfg)
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
	// The features are probed by dataplane.New, after it lifted
	// RLIMIT_MEMLOCK (kernels before 5.11 charge the probes to it), and
	// logged whether it loaded or not.
	dpcfg := a.cfg.Dataplane
	if a.cfg.IstioCNITakeover {
		// A pod under a takeover has a drain table from before its
		// enrolment until istio-cni's connections are gone; they use
		// the same return path as the eBPF redirection.
		dpcfg.SharedReturnPath = func(netns string) bool {
			if _, err := os.Stat(netns); err != nil {
				return false // the pod is gone, and its return path with it
			}
			has, err := istiocni.HasDrain(ctx, netns)
			if err != nil {
				log.Warn("look for a takeover's drain table; the return path stays", "netns", netns, "error", err)
				return true
			}
			return has
		}
	}
	dp, err = dataplane.New(dpcfg)
	features.Log(log)
	a.features = map[string]bool{}
	for _, f := range features.Report() {
		a.features[f.Name] = f.Available
	}
	if err != nil {
		return fmt.Errorf("load data path: %w", err)
	}
	// From here every way out stops the servers (which use the data path)
	// before the data path is kept or removed. Whether to uninstall is
	// decided while they stop, not after: the reconciler's queue may hold
	// thousands of pods, and a DaemonSet's grace period is 30 s.
	stop := func(err error) error {
		srv.halt()
		uninstall := a.uninstalling()
		srv.stop()
		if a.rec != nil {
			a.log.Info("stopped; the pods left queued are reconciled at the next start", "queued", a.rec.Queued())
		}
		return a.shutdown(dp, uninstall, err)
	}
	a.metrics.bpf.setSource(dp)
	a.metrics.decisions.setSource(dp)
	rcfg := reconciler.Config{
		Enrollment: a.cfg.Enrollment, Dataplane: dp, Ztunnel: zsrv, Netns: podnetns.New(a.cfg.ProcRoot),
		RepairInPlace: cmp.Or(a.cfg.Repair.Mode, kube.RepairInPlace) == kube.RepairInPlace,
		Logger:        log.With("component", "reconciler"), Observer: a.metrics.observer(),
	}
	if a.cfg.IstioCNITakeover || a.cfg.IstioCNIHandBack != "" {
		a.istio = istiocni.New()
	}
	if a.cfg.IstioCNITakeover {
		if a.takeover, err = takeover.New(takeover.Config{
			Rules: a.istio, NodeNetns: cmp.Or(a.cfg.Dataplane.NodeNetns, "/proc/self/ns/net"),
			Logger:     log.With("component", "takeover"),
			OnResult:   func(r string) { a.metrics.takeovers.WithLabelValues(r).Inc() },
			OnDraining: func(n int) { a.metrics.draining.Set(float64(n)) },
			Failpoint:  a.cfg.Dataplane.Failpoint,
		}); err != nil {
			return stop(err)
		}
		rcfg.Takeover = a.takeover
	}
	rec, err = reconciler.New(rcfg)
	if err != nil {
		return stop(err)
	}
	a.rec = rec
	countIstioCNI := func() int {
		n := 0
		for _, p := range rec.Pods() {
			if p.IstioCNI {
				n++
			}
		}
		return n
	}
	a.metrics.istioCNIPods.Store(&countIstioCNI)
	rec.Subscribe(listen.observe)
	rec.Adopt(ctx, snap)

	// 4. Handlers: the status writer and the reconciler first, so that
	// the source's first reports find them.
	if listen.run != nil {
		srv.run("status writer", func() error { return listen.run(ctx) })
	}
	srv.run("reconciler", func() error { return rec.Run(ctx) })
	srv.run("pod source", func() error { return src.Run(ctx, rec) })
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
		return events.ServeListener(ctx, cniLn, &cniHandler{lookup: src, rec: rec}, events.WithObserver(a.metrics.observeCNI))
	})
	if a.inst != nil {
		srv.background(func() { a.watchInstall(ctx) })
	}
	hub := newTraceHub(a.cfg.Dataplane.BPFFSDir, a.cfg.TraceHistory, log.With("component", "trace"))
	srv.background(func() { hub.run(ctx) })
	srv.background(func() { a.resyncListeners(ctx, dp) })
	srv.background(func() { a.sweepProbeFlows(ctx, dp) })
	inspectDone, err := serveInspect(ctx, a.cfg.InspectSocket, &inspector{a: a, rec: rec, trace: hub}, log.With("component", "inspect"))
	if err != nil {
		return stop(err)
	}
	srv.watch("inspection server", inspectDone)
	// 6. Ready: every listener is up.
	a.serving.Store(true)
	log.Info("agent ready", "node", a.cfg.NodeName, "enrolled", len(rec.Pods()), "zds", a.cfg.ZDSSocket, "cni", a.cfg.CNISocket)

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-srv.stopped():
	}
	a.serving.Store(false)
	return stop(runErr)
}

// listener is what listens to the reconciler's changes besides the
// metrics: the status writer of the source.
type listener struct {
	observe func(reconciler.Change)
	run     func(ctx context.Context) error // nil: nothing to run
}

func (a *agent) newSource(kcfg kube.Config) (source, listener, error) {
	if a.cfg.StandalonePods != "" {
		if m := cmp.Or(kcfg.Repair.Mode, kube.RepairInPlace); m != kube.RepairInPlace {
			return nil, listener{}, fmt.Errorf("standalone pod file %s: repair mode %q needs the kubernetes api, only %q works", a.cfg.StandalonePods, m, kube.RepairInPlace)
		}
		s, err := standalone.NewSource(a.cfg.NodeName, a.cfg.StandalonePods, kcfg.Logger)
		if err != nil {
			return nil, listener{}, err
		}
		return s, listener{observe: s.Observe}, nil
	}
	rc, err := clientcmd.BuildConfigFromFlags("", a.cfg.Kubeconfig)
	if err != nil {
		return nil, listener{}, fmt.Errorf("kubernetes client config: %w", err)
	}
	a.client, err = kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, listener{}, fmt.Errorf("kubernetes client: %w", err)
	}
	c, err := kube.New(kcfg, a.client)
	if err != nil {
		return nil, listener{}, err
	}
	w, err := kube.NewStatusWriter(kcfg, a.client)
	if err != nil {
		return nil, listener{}, err
	}
	return c, listener{observe: w.Observe, run: w.Run}, nil
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

// watchInstall keeps the install gauge current: the installer reports
// results, not its readiness.
func (a *agent) watchInstall(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		a.metrics.installReady.Set(boolFloat(a.inst.Ready()))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// shutdown keeps the node state, or removes it when uninstall, then
// reports runErr.
func (a *agent) shutdown(dp *dataplane.Dataplane, uninstall bool, runErr error) error {
	if uninstall {
		if a.cfg.IstioCNIHandBack != "" && a.rec != nil {
			if err := a.handBack(dp); err != nil {
				// The pods not handed back keep their eBPF redirection (and
				// its pins) rather than go unredirected.
				a.log.Error("uninstalling: hand-back to istio-cni incomplete; the data path stays for the pods it could not hand back", "error", err)
				var errs []error
				if a.inst != nil {
					errs = append(errs, a.inst.Cleanup())
				}
				return errors.Join(runErr, err, errors.Join(errs...), dp.Close())
			}
		}
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

// handBack writes istio-cni's rules into every pod the data path
// redirects and takes out the pods handed back; an error means some
// were not, and still are redirected by the data path.
func (a *agent) handBack(dp *dataplane.Dataplane) error {
	// Its own time: a pod's rules take tens of milliseconds to write.
	ctx, cancel := context.WithTimeout(context.Background(), HandBackTimeout)
	defer cancel()
	pods := a.rec.Pods()
	a.log.Info("uninstalling: handing the pods back to istio-cni first", "pods", len(pods), "backend", a.cfg.IstioCNIHandBack)
	handed, err := takeover.HandBack(ctx, a.istio, takeover.KernelDrain{}, cmp.Or(a.cfg.Dataplane.NodeNetns, "/proc/self/ns/net"), a.cfg.IstioCNIHandBack, pods,
		a.log.With("component", "takeover"), func(r string) { a.metrics.handbacks.WithLabelValues(r).Inc() })
	// istio-cni's rules of the pods handed back use the very return paths
	// their eBPF enrolment installed: they stay.
	dp.LeaveReturnPaths()
	if err == nil {
		return nil
	}
	for _, uid := range handed {
		if rerr := dp.Remove(ctx, uid); rerr != nil {
			err = errors.Join(err, fmt.Errorf("remove pod uid %s handed back to istio-cni from the data path: %w", uid, rerr))
		}
	}
	return err
}

// HandBackTimeout bounds an uninstall's hand-back to istio-cni.
const HandBackTimeout = 2 * time.Minute

// uninstalling tells an uninstall from a restart or upgrade, and logs
// the decision.
func (a *agent) uninstalling() bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	uninstall := a.decideUninstall(ctx)
	a.log.Info("stopping: uninstall decided", "uninstall", uninstall)
	return uninstall
}

// decideUninstall says uninstall when the agent's DaemonSet is gone,
// being deleted, or its nodeSelector no longer matches this node's labels.
func (a *agent) decideUninstall(ctx context.Context) bool {
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
	if ds.DeletionTimestamp != nil {
		return true
	}
	// Leaving one node (its label changed, for a node-by-node move to or
	// from istio-cni) is an uninstall of that node.
	sel := ds.Spec.Template.Spec.NodeSelector
	if len(sel) == 0 || a.cfg.NodeName == "" {
		return false
	}
	node, err := a.client.CoreV1().Nodes().Get(ctx, a.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		a.log.Warn("cannot tell whether the DaemonSet still selects this node; keeping state", "node", a.cfg.NodeName, "error", err)
		return false
	}
	for k, v := range sel {
		if node.Labels[k] != v {
			a.log.Info("the DaemonSet no longer selects this node: uninstalling from it", "node", a.cfg.NodeName, "label", k, "want", v, "have", node.Labels[k])
			return true
		}
	}
	return false
}
