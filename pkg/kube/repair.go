// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"fmt"
)

// RepairMode says what happens to a running pod that should be ambient but
// that the dataplane does not redirect: it started before the agent was
// ready, it was labelled ambient after it started, or its state was lost.
type RepairMode string

const (
	// RepairInPlace has the reconciler redirect the running pod in place
	// (the default, and what istio-cni does for live enrollment).
	RepairInPlace RepairMode = "inplace"
	// RepairDelete deletes the pod (UID and resourceVersion preconditions)
	// so its owner recreates it through the CNI plugin, which redirects it
	// before the app starts. Connections it made unredirected end.
	RepairDelete RepairMode = "delete"
	// RepairLabel only labels the pod, for an operator or another
	// controller to act on; the pod stays unredirected.
	RepairLabel RepairMode = "label"
	// RepairOff leaves such pods alone.
	RepairOff RepairMode = "off"
)

// MetricType is the mode as istio-cni's istio_cni_repair_pods_repaired_total
// {type} names it ("repair" for in place), "" for RepairOff.
func (m RepairMode) MetricType() string {
	switch m {
	case RepairInPlace:
		return "repair"
	case RepairDelete, RepairLabel:
		return string(m)
	}
	return ""
}

// Repair results (Config.OnRepair), istio-cni's values.
const (
	RepairResultSuccess = "success"
	RepairResultSkip    = "skip"
	RepairResultFail    = "fail"
)

// Istio's label for pods its repair controller found broken.
const (
	DefaultRepairLabelKey   = "cni.istio.io/uninitialized"
	DefaultRepairLabelValue = "true"
)

// Event reasons recorded on repaired pods.
const (
	EventRepairedInPlace = "RedirectionRepaired"
	EventRepairDeleted   = "RedirectionRepairDeletedPod"
	EventRepairLabelled  = "RedirectionRepairLabelledPod"
	EventRepairFailed    = "RedirectionRepairFailed"
)

// RepairConfig configures the repair of unredirected running pods.
type RepairConfig struct {
	// Mode defaults to RepairInPlace.
	Mode RepairMode
	// LabelKey and LabelValue are set by RepairLabel (default
	// cni.istio.io/uninitialized=true).
	LabelKey, LabelValue string
}

func (rc RepairConfig) withDefaults() (RepairConfig, error) {
	if rc.Mode == "" {
		rc.Mode = RepairInPlace
	}
	if rc.LabelKey == "" {
		rc.LabelKey, rc.LabelValue = DefaultRepairLabelKey, DefaultRepairLabelValue
	}
	switch rc.Mode {
	case RepairInPlace, RepairDelete, RepairLabel, RepairOff:
		return rc, nil
	}
	return rc, fmt.Errorf("kube controller config: repair mode %q, want %s, %s, %s or %s", rc.Mode, RepairInPlace, RepairDelete, RepairLabel, RepairOff)
}
