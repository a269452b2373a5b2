// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package decide

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/standalone"
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
		return FileSource(podFile), nil
	case kubeconfig != "":
		return NewKubeSource(kubeconfig)
	}
	return nil, nil
}

// FileSource reads the standalone pod file at the given path on each lookup.
type FileSource string

// Lookup finds the pod and its namespace in the pod file. A pod missing from
// the file is an error: the plugin never guesses.
func (f FileSource) Lookup(_ context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	file, err := standalone.Load(string(f))
	if err != nil {
		return nil, nil, err
	}
	pod := file.Pod(namespace, name)
	if pod == nil {
		return nil, nil, fmt.Errorf("pod %s/%s not in pod file %s", namespace, name, string(f))
	}
	return pod, file.Namespaces[namespace], nil
}

// KubeSource reads pods and namespaces from the API server with plain GETs,
// so the plugin binary carries no generated clientset.
type KubeSource struct {
	host   string
	client *http.Client
}

// NewKubeSource builds a source from the kubeconfig at path.
func NewKubeSource(path string) (*KubeSource, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", path, err)
	}
	client, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("api client from kubeconfig %s: %w", path, err)
	}
	return &KubeSource{host: cfg.Host, client: client}, nil
}

// maxObjectBytes bounds what the plugin reads for one object.
const maxObjectBytes = 4 << 20

// Lookup reads the pod and its namespace.
func (k *KubeSource) Lookup(ctx context.Context, namespace, name string) (*corev1.Pod, *corev1.Namespace, error) {
	pod := &corev1.Pod{}
	if err := k.get(ctx, "/api/v1/namespaces/"+url.PathEscape(namespace)+"/pods/"+url.PathEscape(name), pod); err != nil {
		return nil, nil, fmt.Errorf("read pod %s/%s: %w", namespace, name, err)
	}
	ns := &corev1.Namespace{}
	if err := k.get(ctx, "/api/v1/namespaces/"+url.PathEscape(namespace), ns); err != nil {
		return nil, nil, fmt.Errorf("read namespace %s: %w", namespace, err)
	}
	return pod, ns, nil
}

func (k *KubeSource) get(ctx context.Context, path string, into any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, k.host+path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := k.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxObjectBytes))
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		if len(body) > 256 {
			body = body[:256]
		}
		return fmt.Errorf("get %s: %s: %s", path, resp.Status, body)
	}
	if err := json.Unmarshal(body, into); err != nil {
		return fmt.Errorf("decode %s: %w", path, err)
	}
	return nil
}
