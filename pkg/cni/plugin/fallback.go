// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback"
)

// Decision is the fallback's answer for a pod.
type Decision struct {
	Ambient bool
	Reason  string
}

// The defaults and reasons of pkg/enrollment the plugin needs without the
// agent, repeated here so the plugin binary does not link the Kubernetes
// API types (a test holds them equal).
var defaultExcludedNamespaces = []string{"kube-system"}

const (
	reasonExcludedNS = "namespace excluded"
	reasonSelf       = "the agent's own pod"
)

// FallbackRequest is what the fallback is asked about pod.
func FallbackRequest(conf *Config, pod *cniv1.Pod) fallback.Request {
	return fallback.Request{
		Namespace: pod.GetNamespace(), Name: pod.GetName(), UID: pod.GetUid(), PodFile: conf.PodFile, Kubeconfig: conf.Kubeconfig,
		ExcludeNamespaces: conf.ExcludeNamespaces, SelfLabels: conf.SelfLabels, ZtunnelLabels: conf.ZtunnelLabels, ZtunnelNamespace: conf.ZtunnelNamespace,
		EnablementSelectors: conf.EnablementSelectors, Timeout: DefaultFallbackTimeout,
	}
}

// execFallback asks the fallback binary (FallbackBinary, or
// ambient-ebpf-cni-fallback next to this one) whether the pod is ambient.
func (p *Plugin) execFallback(conf *Config, pod *cniv1.Pod) (Decision, error) {
	if !conf.hasFallback() {
		return Decision{}, errors.New("no kubeconfig or pod file configured to read the pod")
	}
	bin := p.FallbackBinary
	if bin == "" {
		self, err := os.Executable()
		if err != nil {
			return Decision{}, fmt.Errorf("find the fallback binary: %w", err)
		}
		bin = filepath.Join(filepath.Dir(self), fallback.BinaryName)
	}
	req, err := json.Marshal(FallbackRequest(conf, pod))
	if err != nil {
		return Decision{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultFallbackTimeout+time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = bytes.NewReader(req)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return Decision{}, fmt.Errorf("run %s: %w: %s", bin, err, strings.TrimSpace(stderr.String()))
	}
	var resp fallback.Response
	if err := json.Unmarshal(out, &resp); err != nil {
		return Decision{}, fmt.Errorf("decode the answer of %s: %w", bin, err)
	}
	if resp.Error != "" {
		return Decision{}, errors.New(resp.Error)
	}
	return Decision{Ambient: resp.Ambient, Reason: resp.Reason}, nil
}
