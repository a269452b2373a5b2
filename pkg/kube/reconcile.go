// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/identity"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// Config configures the controller; only NodeName is required.
type Config struct {
	// NodeName is this node: only pods with spec.nodeName equal to it are
	// watched.
	NodeName string
	// Enrollment holds the selection settings of contract section 5.
	Enrollment enrollment.Config
	// Repair says what to do with an ambient pod that runs unredirected.
	Repair RepairConfig
	// Workers is the number of reconcile workers (default 2).
	Workers int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnEvent, when set, is called by the informer handlers for each event
	// they reconcile: object is "pod" or "namespace", eventType "add",
	// "update" or "delete" (istio-cni's nodeagent_reconcile_events_total
	// {type} values; namespace updates count only when labels change). It
	// must not block.
	OnEvent func(object, eventType string)
	// OnRepair, when set, is told the outcome of each repair of an
	// unredirected pod: the mode ("repair" in place, "delete" or "label",
	// istio-cni's istio_cni_repair_pods_repaired_total{type}) and the
	// result: "success", "skip" (already labelled) or "fail". It must not
	// block.
	OnRepair func(mode, result string)
}

func (cfg Config) withDefaults() (Config, error) {
	if cfg.NodeName == "" {
		return cfg, errors.New("kube controller config: node name is empty")
	}
	if cfg.Workers <= 0 {
		cfg.Workers = 2
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.OnEvent == nil {
		cfg.OnEvent = func(string, string) {}
	}
	if cfg.OnRepair == nil {
		cfg.OnRepair = func(string, string) {}
	}
	var err error
	cfg.Repair, err = cfg.Repair.withDefaults()
	return cfg, err
}

// podStore is what the reconcile reads: this node's pods and the namespaces.
// Both return nil, nil when the object is absent.
type podStore interface {
	pod(namespace, name string) (*corev1.Pod, error)
	namespace(name string) (*corev1.Namespace, error)
}

// podWriter is where the reconcile's results go: the API server, or a log
// for the standalone pod file.
type podWriter interface {
	// setRedirection writes r as the redirection annotation through the
	// pods/status subresource, or removes the annotation for RedirectionNone.
	setRedirection(ctx context.Context, pod *corev1.Pod, r Redirection) error
	// deletePod deletes the pod with UID and resourceVersion preconditions.
	deletePod(ctx context.Context, pod *corev1.Pod) error
	// labelPod sets one label on the pod.
	labelPod(ctx context.Context, pod *corev1.Pod, key, value string) error
	// event records a Kubernetes Event on the pod.
	event(pod *corev1.Pod, eventType, reason, message string)
}

// reconciler brings one pod at a time to its desired state. It is shared by
// the Kubernetes controller and the standalone file source.
type reconciler struct {
	cfg    Config
	mesh   Mesh
	store  podStore
	writer podWriter
	log    *slog.Logger

	mu sync.Mutex
	// known holds, by namespace/name, the last seen object of each pod
	// the Mesh redirects, so a deleted or recreated pod is removed by the
	// UID it had.
	known map[string]*corev1.Pod
}

func newReconciler(cfg Config, mesh Mesh, store podStore, writer podWriter) *reconciler {
	return &reconciler{
		cfg: cfg, mesh: mesh, store: store, writer: writer,
		log:   cfg.Logger,
		known: map[string]*corev1.Pod{},
	}
}

// reconcile handles the pod with key namespace/name.
func (r *reconciler) reconcile(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return fmt.Errorf("pod key %q: %w", key, err)
	}
	pod, err := r.store.pod(ns, name)
	if err != nil {
		return fmt.Errorf("get pod %s: %w", key, err)
	}
	if pod != nil {
		if err := checkPod(pod); err != nil {
			// Not retried: the object will not become valid. A pod known
			// under this key before still leaves below.
			r.log.Warn("pod skipped: invalid identity", "pod", key, "error", err)
			pod = nil
		}
	}
	// A pod that is gone, or replaced by a pod of the same name, leaves the
	// mesh under the UID it had.
	if prev := r.lookup(key); prev != nil && (pod == nil || pod.UID != prev.UID) {
		if err := r.mesh.RemovePodFromMesh(ctx, prev); err != nil {
			return fmt.Errorf("remove deleted pod %s (uid %s) from mesh: %w", key, prev.UID, err)
		}
		r.forget(key, prev)
		r.log.Info("pod left the mesh", "pod", key, "uid", prev.UID, "reason", "deleted")
	}
	if pod == nil {
		return nil
	}
	nsObj, err := r.store.namespace(ns)
	if err != nil {
		return fmt.Errorf("get namespace of pod %s: %w", key, err)
	}
	d := enrollment.Decide(r.cfg.Enrollment, pod, nsObj)
	state := r.mesh.Redirection(pod.UID)
	if !d.Ambient {
		if state != RedirectionNone || r.lookup(key) != nil {
			if err := r.mesh.RemovePodFromMesh(ctx, pod); err != nil {
				return fmt.Errorf("remove pod %s from mesh: %w", key, err)
			}
			r.forget(key, pod)
			r.log.Info("pod left the mesh", "pod", key, "uid", pod.UID, "reason", d.Reason)
		}
		return r.publish(ctx, pod, RedirectionNone)
	}
	if state == RedirectionNone {
		// Pods that have not started are the CNI plugin's: it redirects
		// them before their first instruction, and the status update
		// that follows brings them back here. Until then nothing
		// redirects them, so an annotation they carry (a sandbox the
		// agent no longer holds) is stale and goes.
		if pod.Status.Phase != corev1.PodRunning || pod.Status.PodIP == "" {
			return r.publish(ctx, pod, RedirectionNone)
		}
		if err := r.repair(ctx, pod, d); err != nil {
			// Retried; meanwhile istiod must not take the pod as
			// captured.
			return errors.Join(err, r.publish(ctx, pod, RedirectionNone))
		}
		state = r.mesh.Redirection(pod.UID)
	}
	if state != RedirectionNone {
		r.remember(key, pod)
	}
	return r.publish(ctx, pod, state)
}

// publish makes the pod's redirection annotation say state.
func (r *reconciler) publish(ctx context.Context, pod *corev1.Pod, state Redirection) error {
	if Redirection(pod.Annotations[enrollment.RedirectionAnnotation]) == state {
		return nil
	}
	if err := r.writer.setRedirection(ctx, pod, state); err != nil {
		return fmt.Errorf("set redirection %q on pod %s/%s: %w", state, pod.Namespace, pod.Name, err)
	}
	return nil
}

func (r *reconciler) lookup(key string) *corev1.Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.known[key]
}

func (r *reconciler) remember(key string, pod *corev1.Pod) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.known[key] = pod
}

// forget drops key if it still names pod's UID.
func (r *reconciler) forget(key string, pod *corev1.Pod) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.known[key]; p != nil && p.UID == pod.UID {
		delete(r.known, key)
	}
}

// checkPod checks the identity of a pod from the API server or the pod file
// before anything uses it (pkg/identity): its UID names its pins.
func checkPod(pod *corev1.Pod) error {
	return identity.Pod(pod.Namespace, pod.Name, string(pod.UID))
}

// validPods returns the pods that pass checkPod, logging the others.
func validPods(pods []*corev1.Pod, log *slog.Logger) []*corev1.Pod {
	return slices.DeleteFunc(pods, func(p *corev1.Pod) bool {
		err := checkPod(p)
		if err != nil {
			log.Warn("pod skipped: invalid identity", "pod", p.Namespace+"/"+p.Name, "error", err)
		}
		return err != nil
	})
}

// newQueue returns the rate-limited queue of pod keys.
func newQueue(name string) workqueue.TypedRateLimitingInterface[string] {
	return workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedItemExponentialFailureRateLimiter[string](50*time.Millisecond, 30*time.Second),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: name},
	)
}

// runWorkers drains queue with n workers until ctx ends, then shuts the
// queue down and waits for the workers.
func runWorkers(ctx context.Context, queue workqueue.TypedRateLimitingInterface[string], n int, log *slog.Logger, reconcile func(context.Context, string) error) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for {
				key, quit := queue.Get()
				if quit {
					return
				}
				if err := reconcile(ctx, key); err != nil {
					if ctx.Err() == nil {
						log.Warn("reconcile failed; retrying", "pod", key, "attempt", queue.NumRequeues(key)+1, "err", err)
						queue.AddRateLimited(key)
					}
				} else {
					queue.Forget(key)
				}
				queue.Done(key)
			}
		})
	}
	<-ctx.Done()
	queue.ShutDown()
	wg.Wait()
}
