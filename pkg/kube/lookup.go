// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Lookup returns a pod of this node and its namespace for a CNI ADD: from
// the informer caches, or with a direct API read when the pod is not cached
// yet (a new pod's ADD can arrive before its watch event). A pod that
// exists nowhere, or whose identity is invalid, is an error: the caller must
// fail closed.
func (c *Controller) Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	store := listerStore{c.podLister, c.nsLister}
	pod, err := store.pod(namespace, name)
	if err == nil && pod == nil {
		pod, err = c.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read pod %s/%s: %w", namespace, name, err)
	}
	if err := checkPod(pod); err != nil {
		return nil, nil, fmt.Errorf("read pod %s/%s: %w", namespace, name, err)
	}
	ns, err := store.namespace(namespace)
	if err == nil && ns == nil {
		ns, err = c.client.CoreV1().Namespaces().Get(ctx, namespace, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			ns, err = nil, nil
		}
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read namespace %s: %w", namespace, err)
	}
	return pod, ns, nil
}
