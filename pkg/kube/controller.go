// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync/atomic"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
)

// EventSource is the component name on the Events the status writer records.
const EventSource = "ambient-ebpf"

// Config configures the controller and the status writer; only NodeName is
// required.
type Config struct {
	// NodeName is this node: only pods with spec.nodeName equal to it are
	// watched.
	NodeName string
	// Repair says what to do with an ambient pod that runs unredirected.
	Repair RepairConfig
	// Workers is the number of status writer workers (default 2).
	Workers int
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnEvent, when set, is called by the informer handlers for each event
	// they report: object is "pod" or "namespace", eventType "add",
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

// Controller watches this node's pods and all namespaces and reports each
// pod, with its namespace, to the reconciler. See the package comment for
// the start-up order.
type Controller struct {
	cfg    Config
	client kubernetes.Interface

	podFactory, nsFactory informers.SharedInformerFactory
	pods                  cache.SharedIndexInformer
	namespaces            cache.SharedIndexInformer
	podLister             listerscorev1.PodLister
	nsLister              listerscorev1.NamespaceLister
	started               atomic.Bool
}

// New builds a controller; it does no I/O.
func New(cfg Config, client kubernetes.Interface) (*Controller, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	c := &Controller{cfg: cfg, client: client}
	c.podFactory = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", cfg.NodeName).String()
		}))
	c.nsFactory = informers.NewSharedInformerFactory(client, 0)
	c.pods = c.podFactory.Core().V1().Pods().Informer()
	c.podLister = c.podFactory.Core().V1().Pods().Lister()
	c.namespaces = c.nsFactory.Core().V1().Namespaces().Informer()
	c.nsLister = c.nsFactory.Core().V1().Namespaces().Lister()
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
		if enrollment.Redirection(p.Annotations[enrollment.RedirectionAnnotation]) == enrollment.RedirectionEnabled {
			out = append(out, p.DeepCopy())
		}
	}
	return validPods(out, c.cfg.Logger), nil
}

// Run adds the informer handlers, which report to sink every cached pod
// once and then each change, tells sink Synced once the cached pods are
// reported, and returns when ctx ends.
func (c *Controller) Run(ctx context.Context, sink reconciler.Desired) error {
	if !c.started.Load() {
		return errors.New("run before the caches are synced (call Start)")
	}
	podReg, err := c.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.cfg.OnEvent("pod", "add"); c.reportObject(sink, obj) },
		UpdateFunc: func(_, obj any) { c.cfg.OnEvent("pod", "update"); c.reportObject(sink, obj) },
		DeleteFunc: func(obj any) { c.cfg.OnEvent("pod", "delete"); c.reportObject(sink, obj) },
	})
	if err != nil {
		return fmt.Errorf("add pod handler: %w", err)
	}
	defer c.pods.RemoveEventHandler(podReg) //nolint:errcheck // only fails for an unknown registration
	nsReg, err := c.namespaces.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(obj any) {
			if ns, ok := obj.(*corev1.Namespace); ok {
				c.cfg.OnEvent("namespace", "add")
				c.reportNamespace(sink, ns)
			}
		},
		UpdateFunc: func(oldObj, obj any) {
			o, ok1 := oldObj.(*corev1.Namespace)
			n, ok2 := obj.(*corev1.Namespace)
			if ok1 && ok2 && !maps.Equal(o.Labels, n.Labels) {
				c.cfg.OnEvent("namespace", "update")
				c.reportNamespace(sink, n)
			}
		},
	})
	if err != nil {
		return fmt.Errorf("add namespace handler: %w", err)
	}
	defer c.namespaces.RemoveEventHandler(nsReg) //nolint:errcheck // only fails for an unknown registration
	if !cache.WaitForCacheSync(ctx.Done(), podReg.HasSynced) {
		return nil // ctx ended
	}
	sink.Synced()
	c.cfg.Logger.Info("kube controller running", "node", c.cfg.NodeName, "repair", c.cfg.Repair.Mode)
	<-ctx.Done()
	return nil
}

// reportObject reports the pod of an informer event, with its namespace
// from the cache; a deleted pod is reported gone.
func (c *Controller) reportObject(sink reconciler.Desired, obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err != nil {
		c.cfg.Logger.Warn("pod event without a key", "error", err)
		return
	}
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		c.cfg.Logger.Warn("pod event with a bad key", "pod", key, "error", err)
		return
	}
	// The cache, not the event, is the truth: a delete event of a pod
	// recreated meanwhile reports the new one.
	store := listerStore{c.podLister, c.nsLister}
	pod, err := store.pod(ns, name)
	if err != nil {
		c.cfg.Logger.Warn("read cached pod", "pod", key, "error", err)
		return
	}
	if pod == nil {
		sink.DeletePod(ns, name)
		return
	}
	nsObj, err := store.namespace(ns)
	if err != nil {
		c.cfg.Logger.Warn("read cached namespace", "namespace", ns, "error", err)
	}
	sink.SetPod(pod, nsObj)
}

// reportNamespace reports this node's pods of the namespace again: its
// labels decide their enrollment.
func (c *Controller) reportNamespace(sink reconciler.Desired, ns *corev1.Namespace) {
	pods, err := c.pods.GetIndexer().ByIndex(cache.NamespaceIndex, ns.Name)
	if err != nil {
		c.cfg.Logger.Warn("list pods of namespace", "namespace", ns.Name, "error", err)
		return
	}
	for _, p := range pods {
		if pod, ok := p.(*corev1.Pod); ok {
			sink.SetPod(pod, ns)
		}
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

// checkPod checks the identity of a pod from the API server before
// anything uses it (pkg/validate): its UID names its pins.
func checkPod(pod *corev1.Pod) error {
	return validate.Pod(pod.Namespace, pod.Name, string(pod.UID))
}

// validPods returns the pods that pass checkPod, logging the others.
func validPods(pods []*corev1.Pod, log *slog.Logger) []*corev1.Pod {
	return slices.DeleteFunc(pods, func(p *corev1.Pod) bool {
		err := checkPod(p)
		if err != nil {
			log.Warn("pod skipped: invalid name or uid", "pod", p.Namespace+"/"+p.Name, "error", err)
		}
		return err != nil
	})
}
