// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package decide is the fallback binary's logic: read the pod (API or
// standalone pod file) and apply the enrollment rules.
package decide

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

// Decide reads the pod and its namespace from src and applies the
// enrollment rules.
func Decide(ctx context.Context, src PodSource, req fallback.Request) (fallback.Response, error) {
	if src == nil {
		return fallback.Response{}, errors.New("no kubeconfig or pod file configured to read the pod")
	}
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, req.Timeout)
		defer cancel()
	}
	pod, ns, err := src.Lookup(ctx, req.Namespace, req.Name)
	if err != nil {
		return fallback.Response{}, err
	}
	if req.UID != "" && pod.UID != "" && string(pod.UID) != req.UID {
		// Another pod of the same name (an older one, or one the reader
		// does not see yet): nothing can be decided about this one.
		return fallback.Response{}, fmt.Errorf("pod %s/%s: the runtime names uid %s, the read pod has uid %s", req.Namespace, req.Name, req.UID, pod.UID)
	}
	sel, err := selection(req)
	if err != nil {
		return fallback.Response{}, err
	}
	d := enrollment.Decide(sel, pod, ns)
	return fallback.Response{Ambient: d.Ambient, Reason: string(d.Reason)}, nil
}

func selection(r fallback.Request) (enrollment.Config, error) {
	e := enrollment.DefaultConfig()
	if len(r.EnablementSelectors) > 0 {
		sel, err := enrollment.ParseSelectors(r.EnablementSelectors)
		if err != nil {
			return e, err
		}
		e.Selectors = sel
	}
	if r.ExcludeNamespaces != nil {
		e.ExcludedNamespaces = r.ExcludeNamespaces
	}
	if r.SelfLabels != nil {
		e.SelfLabels = r.SelfLabels
	}
	if r.ZtunnelLabels != nil {
		e.ZtunnelLabels = r.ZtunnelLabels
	}
	if r.ZtunnelNamespace != "" {
		e.ZtunnelNamespace = r.ZtunnelNamespace
	}
	return e, nil
}

// maxRequestBytes bounds what the binary reads from the plugin.
const maxRequestBytes = 1 << 20

// Run is the fallback binary: one Request on stdin, one Response on stdout.
// A decision that cannot be made is a Response with Error set (and a nil
// return); only broken input or output is an error.
func Run(ctx context.Context, stdin io.Reader, stdout io.Writer) error {
	var req fallback.Request
	if err := json.NewDecoder(io.LimitReader(stdin, maxRequestBytes)).Decode(&req); err != nil {
		return fmt.Errorf("decode request: %w", err)
	}
	var resp fallback.Response
	src, err := NewPodSource(req.PodFile, req.Kubeconfig)
	if err == nil {
		resp, err = Decide(ctx, src, req)
	}
	if err != nil {
		resp = fallback.Response{Error: err.Error()}
	}
	if err := json.NewEncoder(stdout).Encode(resp); err != nil {
		return fmt.Errorf("write response: %w", err)
	}
	return nil
}
