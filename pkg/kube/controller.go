// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"sync/atomic"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
)

// EventSource is the component name on the Events the controller records.
const EventSource = "ambient-ebpf"

// Controller watches this node's pods and all namespaces and keeps each pod's
// mesh membership and redirection annotation in line with the enrollment
// selectors. See the package comment for the start-up order.
type Controller struct {
	cfg    Config
	client kubernetes.Interface

	podFactory, nsFactory informers.SharedInformerFactory
	pods                  cache.SharedIndexInformer
	namespaces            cache.SharedIndexInformer
	podLister             listerscorev1.PodLister
	nsLister              listerscorev1.NamespaceLister

	queue   workqueue.TypedRateLimitingInterface[string]
	writer  *apiWriter
	rec     *reconciler
	started atomic.Bool
}

// New builds a controller; it does no I/O.
func New(cfg Config, client kubernetes.Interface, mesh Mesh) (*Controller, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	c := &Controller{cfg: cfg, client: client, queue: newQueue("ambient-ebpf-pods")}
	c.podFactory = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()
		}))
	c.nsFactory = informers.NewSharedInformerFactory(client, 0)
	c.pods = c.podFactory.Core().V1().Pods().Informer()
	c.podLister = c.podFactory.Core().V1().Pods().Lister()
	c.namespaces = c.nsFactory.Core().V1().Namespaces().Informer()
	c.nsLister = c.nsFactory.Core().V1().Namespaces().Lister()
	c.writer = &apiWriter{client: client}
	c.rec = newReconciler(cfg, mesh, listerStore{c.podLister, c.nsLister}, c.writer)
	return c, nil
}

// Start runs the informers and returns once their caches are synced, or
// with an error when ctx ends first. The informers stop when ctx ends.
func (c *Controller) Start(ctx context.Context) error {
	c.podFactory.Start(ctx.Done())
	c.nsFactory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), c.pods.HasSynced, c.namespaces.HasSynced) {
		return fmt.Errorf("sync pod and namespace caches of node %s: %w", c.cfg.NodeName, context.Cause(ctx))
	}
	c.started.Store(true)
	return nil
}

// Snapshot returns the pods of this node annotated
// ambient.istio.io/redirection=enabled, as the cache holds them, without
// those whose identity is invalid (logged); call it after Start. The agent adopts their dataplane state before Run.
func (c *Controller) Snapshot() ([]*corev1.Pod, error) {
	if !c.started.Load() {
		return nil, errors.New("snapshot before the pod cache is synced")
	}
	all, err := c.podLister.List(labels.Everything())
	if err != nil {
		return nil, fmt.Errorf("list cached pods: %w", err)
	}
	var out []*corev1.Pod
	for _, p := range all {
		if p.Annotations[enrollment.RedirectionAnnotation] == enrollment.RedirectionEnabled {
			out = append(out, p.DeepCopy())
		}
	}
	return validPods(out, c.cfg.Logger), nil
}

// Run adds the informer handlers (every cached pod is then reconciled once)
// and reconciles until ctx ends. It returns after the workers have stopped.
func (c *Controller) Run(ctx context.Context) error {
	if !c.started.Load() {
		return errors.New("run before the caches are synced (call Start)")
	}
	// The event pipeline starts here, not in New: it runs goroutines.
	// Events are only recorded by the workers, which start below.
	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	defer broadcaster.Shutdown()
	sink := broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.client.CoreV1().Events("")})
	defer sink.Stop()
	c.writer.recorder = broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: EventSource, Host: c.cfg.NodeName})
	podReg, err := c.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.cfg.OnEvent("pod", "add"); c.enqueueObject(obj) },
		UpdateFunc: func(_, obj any) { c.cfg.OnEvent("pod", "update"); c.enqueueObject(obj) },
		DeleteFunc: func(obj any) { c.cfg.OnEvent("pod", "delete"); c.enqueueObject(obj) },
	})
	if err != nil {
		return fmt.Errorf("add pod handler: %w", err)
	}
	defer c.pods.RemoveEventHandler(podReg) //nolint:errcheck // only fails for an unknown registration
	nsReg, err := c.namespaces.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) { c.cfg.OnEvent("namespace", "add"); c.enqueueNamespace(obj) },
		UpdateFunc: func(oldObj, obj any) {
			o, ok1 := oldObj.(*corev1.Namespace)
			n, ok2 := obj.(*corev1.Namespace)
			if ok1 && ok2 && !maps.Equal(o.Labels, n.Labels) {
				c.cfg.OnEvent("namespace", "update")
				c.enqueueNamespace(n)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("add namespace handler: %w", err)
	}
	defer c.namespaces.RemoveEventHandler(nsReg) //nolint:errcheck // only fails for an unknown registration
	c.cfg.Logger.Info("kube controller running", "node", c.cfg.NodeName, "repair", c.cfg.Repair.Mode)
	runWorkers(ctx, c.queue, c.cfg.Workers, c.cfg.Logger, c.rec.reconcile)
	return nil
}

// Decide tells whether pod belongs in the mesh, with its namespace read
// from the cache; the agent's CNI path uses it so that new pods are decided
// exactly as running ones. Call it after Start.
func (c *Controller) Decide(pod *corev1.Pod) (enrollment.Decision, error) {
	ns, err := listerStore{c.podLister, c.nsLister}.namespace(pod.Namespace)
	if err != nil {
		return enrollment.Decision{}, fmt.Errorf("namespace of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return enrollment.Decide(c.cfg.Enrollment, pod, ns), nil
}

// Requeue asks for the pod to be reconciled again, for example when ztunnel
// acknowledged it and its annotation should go from pending to enabled.
func (c *Controller) Requeue(namespace, name string) {
	c.queue.Add(namespace + "/" + name)
}

func (c *Controller) enqueueObject(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		c.cfg.Logger.Warn("pod event without a key", "err", err)
		return
	}
	c.queue.Add(key)
}

// enqueueNamespace queues this node's pods of the namespace: its labels
// decide their enrollment.
func (c *Controller) enqueueNamespace(obj any) {
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return
	}
	pods, err := c.pods.GetIndexer().ByIndex(cache.NamespaceIndex, ns.Name)
	if err != nil {
		c.cfg.Logger.Warn("list pods of namespace", "namespace", ns.Name, "err", err)
		return
	}
	for _, p := range pods {
		c.enqueueObject(p)
	}
}

// listerStore reads the informer caches.
type listerStore struct {
	pods listerscorev1.PodLister
	ns   listerscorev1.NamespaceLister
}

func (s listerStore) pod(namespace, name string) (*corev1.Pod, error) {
	p, err := s.pods.Pods(namespace).Get(name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return p, err
}

func (s listerStore) namespace(name string) (*corev1.Namespace, error) {
	ns, err := s.ns.Get(name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return ns, err
}

// apiWriter writes to the API server.
type apiWriter struct {
	client   kubernetes.Interface
	recorder record.EventRecorder
}

// setRedirection merge-patches the annotation through pods/status. The patch
// carries the pod's UID, which the API server refuses to change: a pod
// recreated under the same name is never annotated for its predecessor.
func (w *apiWriter) setRedirection(ctx context.Context, pod *corev1.Pod, r Redirection) error {
	var value any // nil removes the annotation
	if r != RedirectionNone {
		value = string(r)
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":         pod.UID,
		"annotations": map[string]any{enrollment.RedirectionAnnotation: value},
	}})
	if err != nil {
		return err
	}
	_, err = w.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

func (w *apiWriter) deletePod(ctx context.Context, pod *corev1.Pod) error {
	return w.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		Preconditions: &metav1.Preconditions{UID: &pod.UID, ResourceVersion: &pod.ResourceVersion},
	})
}

// labelPod merge-patches the label through pods/status, as Istio's repair
// controller does: the status subresource takes metadata changes too, and
// patch on pods/status (which the annotation needs anyway) grants less
// than patch on pods, which could change the pod's spec.
func (w *apiWriter) labelPod(ctx context.Context, pod *corev1.Pod, key, value string) error {
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":    pod.UID,
		"labels": map[string]string{key: value},
	}})
	if err != nil {
		return err
	}
	_, err = w.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	return err
}

func (w *apiWriter) event(pod *corev1.Pod, eventType, reason, message string) {
	w.recorder.Event(pod, eventType, reason, message)
}
