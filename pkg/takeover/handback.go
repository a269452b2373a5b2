// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// Writer writes istio-cni's state (*istiocni.RuleManager).
type Writer interface {
	// ApplyPod writes istio-cni's exact in-pod rules for o in backend b,
	// keeping every established connection of the pod.
	ApplyPod(ctx context.Context, path string, b istiocni.Backend, o podopts.Options) error
	// ApplyNode writes istio-cni's host probe rule and ipsets.
	ApplyNode(ctx context.Context, path string, b istiocni.Backend) error
	// AddProbeEntries puts a pod's IPs in istio-cni's probe ipsets.
	AddProbeEntries(ctx context.Context, path, uid string, ips []netip.Addr) error
}

// HandBack gives the pods the data path redirects back to istio-cni, in
// backend b: its node probe rule first, then for each pod its exact rules
// (written while the eBPF redirection still holds, so that one of the two
// redirects the pod at every moment) and its probe entries. It returns the
// UIDs handed back, for the caller to remove from the data path; a pod
// that failed is not among them and must stay on eBPF (err says which).
// Pods istio-cni's rules redirect already count as handed back. A drain
// left from a takeover goes too: istio-cni's rules hold conntrack again.
func HandBack(ctx context.Context, w Writer, drain Drain, nodeNetns string, b istiocni.Backend, pods []reconciler.Pod, log *slog.Logger, onResult func(string)) ([]string, error) {
	if log == nil {
		log = slog.Default()
	}
	result := func(r string) {
		if onResult != nil {
			onResult(r)
		}
	}
	if err := w.ApplyNode(ctx, nodeNetns, b); err != nil {
		for range pods {
			result(ResultHandFailed)
		}
		return nil, fmt.Errorf("hand back to istio-cni: node probe rule (%s): %w", b, err)
	}
	var handed []string
	var errs []error
	for _, p := range pods {
		key := p.Namespace + "/" + p.Name
		if p.IstioCNI {
			handed = append(handed, p.UID)
			continue
		}
		err := handBackPod(ctx, w, drain, nodeNetns, b, p)
		if err != nil {
			log.Error("hand back to istio-cni failed; the pod stays on eBPF", "pod", key, "uid", p.UID, "error", err)
			errs = append(errs, err)
			result(ResultHandFailed)
			continue
		}
		log.Info("handed back to istio-cni", "pod", key, "uid", p.UID, "backend", b)
		handed = append(handed, p.UID)
		result(ResultHandedBack)
	}
	return handed, errors.Join(errs...)
}

func handBackPod(ctx context.Context, w Writer, drain Drain, nodeNetns string, b istiocni.Backend, p reconciler.Pod) error {
	key := p.Namespace + "/" + p.Name
	if p.Netns == "" {
		return fmt.Errorf("hand back pod %s to istio-cni: its netns is not known", key)
	}
	o := p.Options
	if err := w.ApplyPod(ctx, p.Netns, b, o); err != nil {
		return fmt.Errorf("hand back pod %s to istio-cni: %w", key, err)
	}
	if err := w.AddProbeEntries(ctx, nodeNetns, p.UID, p.IPs); err != nil {
		return fmt.Errorf("hand back pod %s to istio-cni: probe entries: %w", key, err)
	}
	if err := drain.Remove(ctx, p.Netns); err != nil {
		return fmt.Errorf("hand back pod %s to istio-cni: %w", key, err)
	}
	return nil
}
