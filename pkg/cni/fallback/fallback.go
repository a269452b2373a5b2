// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package fallback is the protocol between the CNI plugin and its fallback
// binary, ambient-ebpf-cni-fallback (package decide), which decides, when
// the node agent cannot be reached, whether a pod may start without it.
// The decision needs the Kubernetes client and API types; in a binary of
// its own that the plugin execs only then, they are not initialised on
// every CNI call, where they were most of the plugin's start-up. This
// package links neither.
package fallback

import (
	"encoding/json"
	"time"
)

// BinaryName is the fallback binary; the installer puts it next to the plugin.
const BinaryName = "ambient-ebpf-cni-fallback"

// Request is what the plugin asks, as JSON on the binary's stdin.
type Request struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// UID is K8S_POD_UID when the runtime passes it: the pod read must
	// be this one, not an older pod of the same name.
	UID string `json:"uid,omitempty"`
	// PodFile or Kubeconfig: where to read the pod (the plugin's config).
	PodFile    string `json:"podFile,omitempty"`
	Kubeconfig string `json:"kubeconfig,omitempty"`
	// Selection settings of the plugin's config.
	ExcludeNamespaces []string          `json:"excludeNamespaces,omitempty"`
	SelfLabels        map[string]string `json:"selfLabels,omitempty"`
	ZtunnelLabels     map[string]string `json:"ztunnelLabels,omitempty"`
	ZtunnelNamespace  string            `json:"ztunnelNamespace,omitempty"`
	// EnablementSelectors are the agent's enablement selectors as the
	// plugin's config carries them (JSON); empty: the label rule.
	EnablementSelectors json.RawMessage `json:"enablementSelectors,omitempty"`
	// Timeout bounds the read of the pod.
	Timeout time.Duration `json:"timeout,omitempty"`
}

// Response is the decision, as JSON on the binary's stdout.
type Response struct {
	Ambient bool   `json:"ambient"`
	Reason  string `json:"reason,omitempty"`
	// Error, when set, is why no decision could be made.
	Error string `json:"error,omitempty"`
}
