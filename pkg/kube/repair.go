// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"fmt"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// RepairMode says what happens to a running pod that should be ambient but
// that the dataplane does not redirect: it started before the agent was
// ready, it was labelled ambient after it started, or its state was lost.
type RepairMode string

const (
	// RepairInPlace redirects the running pod through Mesh.AddPodToMesh
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

// runsUnredirected reports whether the pod has a container that runs, or
// ran and failed, without redirection. A container whose current state is
// terminated with reason Completed or exit code 0 did its work and is never
// counted as broken, so a pod made only of those is left alone.
func runsUnredirected(pod *corev1.Pod) bool {
	if len(pod.Status.ContainerStatuses) == 0 {
		return true
	}
	for _, cs := range pod.Status.ContainerStatuses {
		if t := cs.State.Terminated; t != nil && (t.Reason == "Completed" || t.ExitCode == 0) {
			continue
		}
		return true
	}
	return false
}

// repair acts on a running ambient pod the dataplane does not redirect.
func (r *reconciler) repair(ctx context.Context, pod *corev1.Pod, d enrollment.Decision) error {
	if r.cfg.Repair.Mode == RepairOff || pod.DeletionTimestamp != nil || !runsUnredirected(pod) {
		return nil // repair is off, the pod is going away already, or done with its work
	}
	key := pod.Namespace + "/" + pod.Name
	log := r.log.With("pod", key, "uid", pod.UID, "mode", r.cfg.Repair.Mode, "reason", d.Reason)
	mode := r.cfg.Repair.Mode.MetricType()
	switch r.cfg.Repair.Mode {
	case RepairDelete:
		if err := r.writer.deletePod(ctx, pod); err != nil {
			if apierrors.IsNotFound(err) {
				r.cfg.OnRepair(mode, RepairResultSkip)
				return nil
			}
			// A Conflict means the pod changed under us: the update
			// requeues it, and the retry decides again.
			r.cfg.OnRepair(mode, RepairResultFail)
			return fmt.Errorf("repair: delete unredirected pod %s: %w", key, err)
		}
		r.writer.event(pod, corev1.EventTypeWarning, EventRepairDeleted,
			"deleted: ambient pod ran without traffic redirection; its owner recreates it redirected")
		log.Info("repair: deleted unredirected pod")
	case RepairLabel:
		if pod.Labels[r.cfg.Repair.LabelKey] == r.cfg.Repair.LabelValue {
			r.cfg.OnRepair(mode, RepairResultSkip)
			return nil
		}
		if err := r.writer.labelPod(ctx, pod, r.cfg.Repair.LabelKey, r.cfg.Repair.LabelValue); err != nil {
			r.cfg.OnRepair(mode, RepairResultFail)
			return fmt.Errorf("repair: label unredirected pod %s: %w", key, err)
		}
		r.writer.event(pod, corev1.EventTypeWarning, EventRepairLabelled,
			fmt.Sprintf("labelled %s=%s: ambient pod runs without traffic redirection", r.cfg.Repair.LabelKey, r.cfg.Repair.LabelValue))
		log.Info("repair: labelled unredirected pod")
	default:
		if err := r.mesh.AddPodToMesh(ctx, pod, d.Options); err != nil {
			r.cfg.OnRepair(mode, RepairResultFail)
			r.writer.event(pod, corev1.EventTypeWarning, EventRepairFailed, "redirecting the running pod failed: "+err.Error())
			return fmt.Errorf("repair: add running pod %s to mesh: %w", key, err)
		}
		r.writer.event(pod, corev1.EventTypeNormal, EventRepairedInPlace, "traffic of the running pod redirected in place")
		log.Info("repair: redirected running pod in place")
	}
	r.cfg.OnRepair(mode, RepairResultSuccess)
	return nil
}
