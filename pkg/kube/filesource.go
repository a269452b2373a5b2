// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/identity"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/standalone"
	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
)

// Source is a source of this node's pods feeding the reconcile: the
// Kubernetes API (Controller) or the standalone pod file (FileSource).
type Source interface {
	Start(ctx context.Context) error
	Snapshot() ([]*corev1.Pod, error)
	Run(ctx context.Context) error
	Requeue(namespace, name string)
}

var (
	_ Source = (*Controller)(nil)
	_ Source = (*FileSource)(nil)
)

// FileSource feeds the reconcile from the standalone pod file (see
// pkg/standalone) instead of the API server, and reloads it when it changes.
// Pods whose spec.nodeName is empty or this node are taken; a pod without
// metadata.uid gets identity.StandaloneUID(namespace, name) as its UID:
// "standalone-" and 28 hex digits of the SHA-256 of "<namespace>/<name>",
// stable across reloads and restarts, and a safe pin directory name (the
// parser refuses invalid names and UIDs, see pkg/standalone). The
// redirection annotation is kept in memory (there is no API to write it to)
// and shows on the pods the reconcile reads. A file that fails to parse is logged and the
// previous content stays in force, so a typo never drops a pod from the mesh.
// Repair can only be in place: there is no API to delete or label pods.
type FileSource struct {
	cfg   Config
	path  string
	queue workqueue.TypedRateLimitingInterface[string]
	rec   *reconciler

	mu          sync.Mutex
	raw         []byte
	file        *standalone.File
	pods        map[string]*corev1.Pod
	redirection map[types.UID]Redirection
}

// NewFileSource builds a source over the pod file at path; it does no I/O.
func NewFileSource(cfg Config, path string, mesh Mesh) (*FileSource, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if cfg.Repair.Mode != RepairInPlace {
		return nil, fmt.Errorf("standalone pod file %s: repair mode %q needs the kubernetes api, only %q works", path, cfg.Repair.Mode, RepairInPlace)
	}
	s := &FileSource{
		cfg: cfg, path: path,
		queue:       newQueue("ambient-ebpf-pod-file"),
		pods:        map[string]*corev1.Pod{},
		redirection: map[types.UID]Redirection{},
	}
	s.rec = newReconciler(cfg, mesh, s, s)
	return s, nil
}

// Start loads the file; unlike later reloads, a file that cannot be read or
// parsed is an error.
func (s *FileSource) Start(context.Context) error {
	_, err := s.load()
	return err
}

// Snapshot returns the file's pods of this node annotated
// ambient.istio.io/redirection=enabled.
func (s *FileSource) Snapshot() ([]*corev1.Pod, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file == nil {
		return nil, errors.New("snapshot before the pod file is loaded")
	}
	var out []*corev1.Pod
	for _, p := range s.pods {
		if p.Annotations[enrollment.RedirectionAnnotation] == enrollment.RedirectionEnabled {
			out = append(out, p.DeepCopy())
		}
	}
	return validPods(out, s.cfg.Logger), nil
}

// Run reconciles every pod of the file, then watches the file's folder and
// reconciles again on each change, until ctx ends.
func (s *FileSource) Run(ctx context.Context) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watch pod file: %w", err)
	}
	defer w.Close()
	// The folder, not the file: editors and ConfigMap volumes replace the
	// file by renaming, which ends a watch on the file itself.
	if err := w.Add(filepath.Dir(s.path)); err != nil {
		return fmt.Errorf("watch folder of pod file %s: %w", s.path, err)
	}
	s.enqueueAll(nil)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case err := <-w.Errors:
				s.cfg.Logger.Warn("pod file watch", "path", s.path, "err", err)
			case <-w.Events:
				old, err := s.load()
				if err != nil {
					s.cfg.Logger.Warn("pod file not reloaded; previous content stays", "err", err)
					continue
				}
				if old != nil {
					s.enqueueAll(old)
				}
			}
		}
	}()
	runWorkers(ctx, s.queue, s.cfg.Workers, s.cfg.Logger, s.rec.reconcile)
	return nil
}

// Requeue asks for the pod to be reconciled again.
func (s *FileSource) Requeue(namespace, name string) { s.queue.Add(namespace + "/" + name) }

// load reads the file and, when its content changed, replaces the pods and
// returns the previous ones (nil when unchanged).
func (s *FileSource) load() (map[string]*corev1.Pod, error) {
	raw, err := os.ReadFile(s.path)
	if err != nil {
		return nil, fmt.Errorf("read pod file: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file != nil && bytes.Equal(raw, s.raw) {
		return nil, nil
	}
	f, err := standalone.Parse(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("pod file %s: %w", s.path, err)
	}
	pods := map[string]*corev1.Pod{}
	uids := map[types.UID]bool{}
	for _, p := range f.Pods {
		if p.Spec.NodeName != "" && p.Spec.NodeName != s.cfg.NodeName {
			continue
		}
		if p.UID == "" {
			// The mesh identifies pods by UID; a file without one
			// gets a stable stand-in per namespace/name.
			p.UID = types.UID(identity.StandaloneUID(p.Namespace, p.Name))
		}
		pods[p.Namespace+"/"+p.Name] = p
		uids[p.UID] = true
	}
	for uid := range s.redirection {
		if !uids[uid] {
			delete(s.redirection, uid)
		}
	}
	old := s.pods
	s.raw, s.file, s.pods = raw, f, pods
	return old, nil
}

// enqueueAll queues every pod of the file and of old: the file is small, and
// a namespace label change concerns all of its pods anyway.
func (s *FileSource) enqueueAll(old map[string]*corev1.Pod) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for key := range old {
		s.queue.Add(key)
	}
	for key := range s.pods {
		s.queue.Add(key)
	}
}

// pod and namespace make FileSource the reconcile's podStore. The pod
// returned carries the in-memory redirection annotation.
func (s *FileSource) pod(namespace, name string) (*corev1.Pod, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pods[namespace+"/"+name]
	if p == nil {
		return nil, nil
	}
	p = p.DeepCopy()
	if r := s.redirection[p.UID]; r != RedirectionNone {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		p.Annotations[enrollment.RedirectionAnnotation] = string(r)
	}
	return p, nil
}

func (s *FileSource) namespace(name string) (*corev1.Namespace, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file == nil {
		return nil, nil
	}
	return s.file.Namespaces[name], nil
}

// setRedirection and the rest make FileSource the reconcile's podWriter.
func (s *FileSource) setRedirection(_ context.Context, pod *corev1.Pod, r Redirection) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r == RedirectionNone {
		delete(s.redirection, pod.UID)
	} else {
		s.redirection[pod.UID] = r
	}
	return nil
}

var errNoAPI = errors.New("not possible with the standalone pod file")

func (s *FileSource) deletePod(context.Context, *corev1.Pod) error { return errNoAPI }

func (s *FileSource) labelPod(context.Context, *corev1.Pod, string, string) error { return errNoAPI }

func (s *FileSource) event(pod *corev1.Pod, eventType, reason, message string) {
	s.cfg.Logger.Info("pod event", "pod", pod.Namespace+"/"+pod.Name, "type", eventType, "reason", reason, "message", message)
}

// Redirection returns the redirection annotation the reconcile published for
// the pod with this UID (the file source's stand-in for the pod status).
func (s *FileSource) Redirection(uid types.UID) Redirection {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.redirection[uid]
}
