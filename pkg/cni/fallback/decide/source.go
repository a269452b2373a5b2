// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package decide

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/podfile"
)

// PodSource reads a pod and its namespace when the agent cannot be asked.
// It is the plugin's only Kubernetes access.
type PodSource interface {
	Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error)
}

// NewPodSource returns the configured source: the standalone pod file when
// set, else the API through the installer's kubeconfig, else nil.
func NewPodSource(podFile, kubeconfig string) (PodSource, error) {
	switch {
	case podFile != "":
		return podfile.FileLookup(podFile), nil
	case kubeconfig != "":
		return NewKubeSource(kubeconfig)
	}
	return nil, nil
}

// KubeSource reads pods and namespaces from the API server with client-go's
// REST client over a scheme of core/v1 alone, so the plugin binary carries
// no generated clientset; the API server's errors keep their metav1.Status
// (apierrors.IsNotFound, IsForbidden work on them).
type KubeSource struct {
	client rest.Interface
}

// NewKubeSource builds a source from the kubeconfig at path.
func NewKubeSource(path string) (*KubeSource, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", path, err)
	}
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		return nil, fmt.Errorf("core/v1 scheme: %w", err)
	}
	cfg.APIPath = "/api"
	cfg.GroupVersion = &corev1.SchemeGroupVersion
	cfg.NegotiatedSerializer = serializer.NewCodecFactory(s).WithoutConversion()
	client, err := rest.RESTClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("api client from kubeconfig %s: %w", path, err)
	}
	return &KubeSource{client: client}, nil
}

// Lookup reads the pod and its namespace.
func (k *KubeSource) Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	pod := &corev1.Pod{}
	if err := k.client.Get().Namespace(namespace).Resource("pods").Name(name).Do(ctx).Into(pod); err != nil {
		return nil, nil, fmt.Errorf("read pod %s/%s: %w", namespace, name, err)
	}
	ns := &corev1.Namespace{}
	if err := k.client.Get().Resource("namespaces").Name(namespace).Do(ctx).Into(ns); err != nil {
		return nil, nil, fmt.Errorf("read namespace %s: %w", namespace, err)
	}
	return pod, ns, nil
}
