// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// podWriter is where the status writer's results go.
type podWriter interface {
	// setRedirection writes r as the redirection annotation through the
	// pods/status subresource, or removes the annotation for enrollment.RedirectionNone.
	setRedirection(ctx context.Context, pod *corev1.Pod, r enrollment.Redirection) error
	// deletePod deletes the pod with UID and resourceVersion preconditions.
	deletePod(ctx context.Context, pod *corev1.Pod) error
	// labelPod sets one label on the pod.
	labelPod(ctx context.Context, pod *corev1.Pod, key, value string) error
	// event records a Kubernetes Event on the pod.
	event(pod *corev1.Pod, eventType, reason, message string)
}

// StatusWriter listens to the reconciler's Changes (Observe) and writes
// them to the API server: the redirection annotation, the Events of
// in-place repairs, and the delete or label repairs (RepairConfig). Each
// pod's latest Change is written by a worker of a rate-limited queue, so a
// failed write is retried with backoff and a burst of Changes costs one
// write.
type StatusWriter struct {
	cfg    Config
	client kubernetes.Interface
	w      podWriter
	queue  workqueue.TypedRateLimitingInterface[string]

	mu      sync.Mutex
	pending map[string]*pendingStatus
}

// pendingStatus is what is left to write for one pod.
type pendingStatus struct {
	latest reconciler.Change
	events []reconciler.Change // in-place repairs to record, oldest first
}

// NewStatusWriter builds a writer to the API server; it does no I/O.
func NewStatusWriter(cfg Config, client kubernetes.Interface) (*StatusWriter, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	return newStatusWriter(cfg, client, &apiWriter{client: client}), nil
}

func newStatusWriter(cfg Config, client kubernetes.Interface, w podWriter) *StatusWriter {
	return &StatusWriter{
		cfg: cfg, client: client, w: w,
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](50*time.Millisecond, 30*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "ambient-ebpf-status"}),
		pending: map[string]*pendingStatus{},
	}
}

// Observe takes one Change (a reconciler listener); it never blocks.
func (s *StatusWriter) Observe(c reconciler.Change) {
	key := c.Namespace + "/" + c.Name
	s.mu.Lock()
	p := s.pending[key]
	if p == nil {
		p = &pendingStatus{}
		s.pending[key] = p
	}
	p.latest = c
	if c.Repair == reconciler.RepairedInPlace || c.Repair == reconciler.RepairFailed {
		p.events = append(p.events, c)
	}
	s.mu.Unlock()
	s.queue.Add(key)
}

// Run writes until ctx ends and returns after its workers stopped.
func (s *StatusWriter) Run(ctx context.Context) error {
	// The event pipeline starts here, not in New: it runs goroutines.
	if aw, ok := s.w.(*apiWriter); ok {
		broadcaster := record.NewBroadcaster(record.WithContext(ctx))
		defer broadcaster.Shutdown()
		sink := broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: s.client.CoreV1().Events("")})
		defer sink.Stop()
		aw.setRecorder(broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: EventSource, Host: s.cfg.NodeName}))
	}
	var wg sync.WaitGroup
	for range s.cfg.Workers {
		wg.Go(func() {
			for {
				key, quit := s.queue.Get()
				if quit {
					return
				}
				if err := s.write(ctx, key); err != nil {
					if ctx.Err() == nil {
						s.cfg.Logger.Warn("writing pod status failed; retrying", "pod", key, "attempt", s.queue.NumRequeues(key)+1, "error", err)
						s.queue.AddRateLimited(key)
					}
				} else {
					s.queue.Forget(key)
				}
				s.queue.Done(key)
			}
		})
	}
	<-ctx.Done()
	s.queue.ShutDown()
	wg.Wait()
	return nil
}

// write brings the pod with key to its latest Change.
func (s *StatusWriter) write(ctx context.Context, key string) error {
	s.mu.Lock()
	p := s.pending[key]
	if p == nil {
		s.mu.Unlock()
		return nil
	}
	c, events := p.latest, p.events
	p.events = nil
	s.mu.Unlock()
	pod := c.Pod
	if pod == nil {
		pod = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: c.Namespace, Name: c.Name, UID: c.UID}}
	}
	for _, e := range events {
		s.recordRepair(e)
	}
	var errs []error
	if c.Repair == reconciler.Unredirected {
		errs = append(errs, s.repair(ctx, pod, c))
	}
	if c.Pod == nil || enrollment.Redirection(c.Pod.Annotations[enrollment.RedirectionAnnotation]) != c.Redirection {
		if err := s.w.setRedirection(ctx, pod, c.Redirection); err != nil {
			errs = append(errs, fmt.Errorf("set redirection %q on pod %s: %w", c.Redirection, key, err))
		}
	}
	err := errors.Join(errs...)
	if err == nil {
		s.mu.Lock()
		if s.pending[key] == p && len(p.events) == 0 && p.latest.Pod == c.Pod && p.latest.Redirection == c.Redirection {
			delete(s.pending, key)
		}
		s.mu.Unlock()
	}
	return err
}

// recordRepair records the Event and the metric of an in-place repair.
func (s *StatusWriter) recordRepair(c reconciler.Change) {
	pod := c.Pod
	if pod == nil {
		pod = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: c.Namespace, Name: c.Name, UID: c.UID}}
	}
	mode := RepairInPlace.MetricType()
	switch c.Repair {
	case reconciler.RepairedInPlace:
		s.w.event(pod, corev1.EventTypeNormal, EventRepairedInPlace, "traffic of the running pod redirected in place")
		s.cfg.OnRepair(mode, RepairResultSuccess)
	case reconciler.RepairFailed:
		msg := "redirecting the running pod failed"
		if c.Err != nil {
			msg += ": " + c.Err.Error()
		}
		s.w.event(pod, corev1.EventTypeWarning, EventRepairFailed, msg)
		s.cfg.OnRepair(mode, RepairResultFail)
	}
}

// repair acts on a running ambient pod the data path does not redirect,
// when the repair is not in place.
func (s *StatusWriter) repair(ctx context.Context, pod *corev1.Pod, c reconciler.Change) error {
	key := pod.Namespace + "/" + pod.Name
	log := s.cfg.Logger.With("pod", key, "uid", pod.UID, "mode", s.cfg.Repair.Mode, "reason", c.Reason)
	mode := s.cfg.Repair.Mode.MetricType()
	switch s.cfg.Repair.Mode {
	case RepairDelete:
		if err := s.w.deletePod(ctx, pod); err != nil {
			if apierrors.IsNotFound(err) {
				s.cfg.OnRepair(mode, RepairResultSkip)
				return nil
			}
			// A Conflict means the pod changed under us: the update
			// reaches the reconciler, and its next Change decides again.
			s.cfg.OnRepair(mode, RepairResultFail)
			return fmt.Errorf("repair: delete unredirected pod %s: %w", key, err)
		}
		s.w.event(pod, corev1.EventTypeWarning, EventRepairDeleted,
			"deleted: ambient pod ran without traffic redirection; its owner recreates it redirected")
		log.Info("repair: deleted unredirected pod")
	case RepairLabel:
		if pod.Labels[s.cfg.Repair.LabelKey] == s.cfg.Repair.LabelValue {
			s.cfg.OnRepair(mode, RepairResultSkip)
			return nil
		}
		if err := s.w.labelPod(ctx, pod, s.cfg.Repair.LabelKey, s.cfg.Repair.LabelValue); err != nil {
			s.cfg.OnRepair(mode, RepairResultFail)
			return fmt.Errorf("repair: label unredirected pod %s: %w", key, err)
		}
		s.w.event(pod, corev1.EventTypeWarning, EventRepairLabelled,
			fmt.Sprintf("labelled %s=%s: ambient pod runs without traffic redirection", s.cfg.Repair.LabelKey, s.cfg.Repair.LabelValue))
		log.Info("repair: labelled unredirected pod")
	default:
		return nil // off (in place is the reconciler's)
	}
	s.cfg.OnRepair(mode, RepairResultSuccess)
	return nil
}

// apiWriter writes to the API server.
type apiWriter struct {
	client kubernetes.Interface

	mu       sync.Mutex
	recorder record.EventRecorder // set by StatusWriter.Run
}

// setRedirection merge-patches the annotation through pods/status. The patch
// carries the pod's UID, which the API server refuses to change: a pod
// recreated under the same name is never annotated for its predecessor.
func (w *apiWriter) setRedirection(ctx context.Context, pod *corev1.Pod, r enrollment.Redirection) error {
	var value any // nil removes the annotation
	if r != enrollment.RedirectionNone {
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

func (w *apiWriter) setRecorder(r record.EventRecorder) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.recorder = r
}

func (w *apiWriter) event(pod *corev1.Pod, eventType, reason, message string) {
	w.mu.Lock()
	r := w.recorder
	w.mu.Unlock()
	if r != nil {
		r.Event(pod, eventType, reason, message)
	}
}
