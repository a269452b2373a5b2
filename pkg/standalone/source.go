// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package standalone

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podfile"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

// Source reports the pods of the pod file to the reconciler instead of the
// API server, and reloads the file when it changes. Pods whose
// spec.nodeName is empty or this node are taken; a pod without
// metadata.uid gets validate.StandaloneUID(namespace, name) as its UID:
// "standalone-" and 28 hex digits of the SHA-256 of "<namespace>/<name>",
// stable across reloads and restarts, and a safe pin directory name (the
// parser refuses invalid names and UIDs). A file that fails to parse is
// logged and the previous content stays in force, so a typo never drops a
// pod from the mesh.
//
// It is also the status listener of the file (Observe): the redirection
// annotation is kept in memory, as there is no API to write it to, and
// Events are logged. Repair can only be in place.
type Source struct {
	node string
	path string
	log  *slog.Logger

	mu          sync.Mutex
	raw         []byte
	file        *podfile.File
	pods        map[string]*corev1.Pod
	redirection map[types.UID]enrollment.Redirection
}

// NewSource builds a source over the pod file at path for node; it does no
// I/O.
func NewSource(node, path string, log *slog.Logger) (*Source, error) {
	if node == "" {
		return nil, errors.New("standalone pod file: node name is empty")
	}
	if log == nil {
		log = slog.Default()
	}
	return &Source{node: node, path: path, log: log,
		pods: map[string]*corev1.Pod{}, redirection: map[types.UID]enrollment.Redirection{}}, nil
}

// Start loads the file; unlike later reloads, a file that cannot be read or
// parsed is an error.
func (s *Source) Start(context.Context) error {
	_, err := s.load()
	return err
}

// Snapshot returns the file's pods of this node annotated
// ambient.istio.io/redirection=enabled.
func (s *Source) Snapshot() ([]*corev1.Pod, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file == nil {
		return nil, errors.New("snapshot before the pod file is loaded")
	}
	var out []*corev1.Pod
	for _, p := range s.pods {
		if enrollment.Redirection(p.Annotations[enrollment.RedirectionAnnotation]) == enrollment.RedirectionEnabled {
			out = append(out, p.DeepCopy())
		}
	}
	return out, nil
}

// Run reports every pod of the file to sink, then watches the file's
// folder and reports again on each change, until ctx ends.
func (s *Source) Run(ctx context.Context, sink reconciler.Desired) error {
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
	s.reportAll(sink, nil)
	sink.Synced()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-w.Errors:
			s.log.Warn("pod file watch", "path", s.path, "error", err)
		case <-w.Events:
			old, err := s.load()
			if err != nil {
				s.log.Warn("pod file not reloaded; previous content stays", "error", err)
				continue
			}
			if old != nil {
				s.reportAll(sink, old)
			}
		}
	}
}

// load reads the file and, when its content changed, replaces the pods and
// returns the previous ones (nil when unchanged).
func (s *Source) load() (map[string]*corev1.Pod, error) {
	raw, err := os.ReadFile(s.path)
	if err != nil {
		return nil, fmt.Errorf("read pod file: %w", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file != nil && bytes.Equal(raw, s.raw) {
		return nil, nil
	}
	f, err := podfile.Parse(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("pod file %s: %w", s.path, err)
	}
	pods := map[string]*corev1.Pod{}
	for _, p := range f.Pods {
		if p.Spec.NodeName != "" && p.Spec.NodeName != s.node {
			continue
		}
		withUID(p)
		pods[p.Namespace+"/"+p.Name] = p
	}
	for uid := range s.redirection {
		if !slices.ContainsFunc(f.Pods, func(p *corev1.Pod) bool { return p.UID == uid }) {
			delete(s.redirection, uid)
		}
	}
	old := s.pods
	s.raw, s.file, s.pods = raw, f, pods
	return old, nil
}

// withUID gives a pod without a UID its stable stand-in: the mesh
// identifies pods by UID.
func withUID(p *corev1.Pod) {
	if p.UID == "" {
		p.UID = types.UID(validate.StandaloneUID(p.Namespace, p.Name))
	}
}

// reportAll reports every pod of the file, and old's that are gone: the
// file is small, and a namespace label change concerns all of its pods
// anyway.
func (s *Source) reportAll(sink reconciler.Desired, old map[string]*corev1.Pod) {
	s.mu.Lock()
	type report struct {
		pod *corev1.Pod
		ns  *corev1.Namespace
	}
	var set []report
	var gone []string
	for key := range old {
		if s.pods[key] == nil {
			gone = append(gone, key)
		}
	}
	for _, p := range s.pods {
		set = append(set, report{p.DeepCopy(), s.file.Namespaces[p.Namespace]})
	}
	s.mu.Unlock()
	slices.Sort(gone)
	for _, key := range gone {
		p := old[key]
		sink.DeletePod(p.Namespace, p.Name)
	}
	for _, r := range set {
		sink.SetPod(r.pod, r.ns)
	}
}

// Lookup returns a pod and its namespace from the pod file, for a CNI ADD.
func (s *Source) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.file == nil {
		return nil, nil, fmt.Errorf("pod %s/%s: the pod file %s is not loaded", namespace, name, s.path)
	}
	if s.pods[namespace+"/"+name] == nil {
		return nil, nil, fmt.Errorf("pod %s/%s is not in the pod file %s", namespace, name, s.path)
	}
	return lookup(s.file, s.path, namespace, name)
}

// lookup returns a copy of the pod, with its UID as the agent knows it, and
// its namespace.
func lookup(f *podfile.File, path, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	pod := f.Pod(namespace, name)
	if pod == nil {
		return nil, nil, fmt.Errorf("pod %s/%s not in pod file %s", namespace, name, path)
	}
	pod = pod.DeepCopy()
	withUID(pod)
	return pod, f.Namespaces[namespace], nil
}

// Observe keeps each Change's state as the pod's in-memory annotation and
// logs its repair (a reconciler listener; it never blocks).
func (s *Source) Observe(c reconciler.Change) {
	s.mu.Lock()
	if c.Redirection == enrollment.RedirectionNone {
		delete(s.redirection, c.UID)
	} else {
		s.redirection[c.UID] = c.Redirection
	}
	s.mu.Unlock()
	switch c.Repair {
	case reconciler.RepairedInPlace:
		s.log.Info("pod event", "pod", c.Namespace+"/"+c.Name, "type", corev1.EventTypeNormal, "reason", "RedirectionRepaired",
			"message", "traffic of the running pod redirected in place")
	case reconciler.RepairFailed:
		s.log.Info("pod event", "pod", c.Namespace+"/"+c.Name, "type", corev1.EventTypeWarning, "reason", "RedirectionRepairFailed",
			"message", "redirecting the running pod failed", "error", c.Err)
	}
}

// Redirection returns the state last published for the pod with this UID
// (the file's stand-in for the annotation on the pod status).
func (s *Source) Redirection(uid types.UID) enrollment.Redirection {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.redirection[uid]
}
