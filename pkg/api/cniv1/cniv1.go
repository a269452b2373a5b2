// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package cniv1 is the wire API between the CNI plugin and the node agent.
// The plugin runs once per CNI ADD/DEL/STATUS: it dials the agent's
// root-only unix socket, writes one request frame, reads one answer frame
// and exits. The agent decides whether the pod is ambient (contract
// section 5) and enrolls it before it answers an ADD, so an ambient pod
// never starts unredirected.
//
// A frame is a 10-byte header and a JSON body (wire.go):
//
//	"AECN" | version (1 byte) | kind (1 byte) | body length (uint32, big endian) | body
//
// The format is this small so that the plugin, which runs on every pod
// start, links no gRPC, HTTP/2 or protobuf: its start-up is most of a CNI
// ADD. The types keep the field and getter names of the protobuf messages
// they replaced.
package cniv1

import "fmt"

// Pod identifies the pod sandbox a CNI call is about.
type Pod struct {
	// Name is K8S_POD_NAME.
	Name string `json:"name,omitempty"`
	// Namespace is K8S_POD_NAMESPACE.
	Namespace string `json:"namespace,omitempty"`
	// Uid is K8S_POD_UID; empty when the runtime does not pass it.
	Uid string `json:"uid,omitempty"`
	// ContainerId is CNI_CONTAINERID (the sandbox id).
	ContainerId string `json:"containerId,omitempty"`
	// Netns is CNI_NETNS, a path such as /var/run/netns/cni-1234.
	Netns string `json:"netns,omitempty"`
	// Interface is CNI_IFNAME, the pod-side interface the primary CNI set up.
	Interface string `json:"interface,omitempty"`
}

// PodAddRequest is sent on CNI ADD, after the primary CNI configured the
// pod's network. An error answer means the pod could not be enrolled; the
// plugin then fails the ADD (fail-closed).
type PodAddRequest struct {
	Pod *Pod
	// Ips are the pod's addresses from the previous plugin's result, without
	// prefix length (for example "198.18.0.5", "fd00:198:18::5").
	Ips []string
}

// PodAddResponse is the agent's answer to an ADD it handled.
type PodAddResponse struct {
	// Enrolled is true when the pod is now redirected to ztunnel, false when
	// the agent decided the pod is not ambient and left it alone.
	Enrolled bool `json:"enrolled,omitempty"`
	// Reason says why, for the plugin's log (e.g. "namespace labelled ambient").
	Reason string `json:"reason,omitempty"`
}

// PodDelRequest is sent on CNI DEL. Errors are logged by the plugin, never
// returned to the runtime: the agent reconciles removed pods by itself.
type PodDelRequest struct {
	Pod *Pod
}

// The getters answer the zero value on a nil receiver, as the protobuf
// ones did, so a request without a pod reads as an empty pod.

func (p *Pod) GetName() string {
	if p == nil {
		return ""
	}
	return p.Name
}

func (p *Pod) GetNamespace() string {
	if p == nil {
		return ""
	}
	return p.Namespace
}

func (p *Pod) GetUid() string {
	if p == nil {
		return ""
	}
	return p.Uid
}

func (p *Pod) GetContainerId() string {
	if p == nil {
		return ""
	}
	return p.ContainerId
}

func (p *Pod) GetNetns() string {
	if p == nil {
		return ""
	}
	return p.Netns
}

func (p *Pod) GetInterface() string {
	if p == nil {
		return ""
	}
	return p.Interface
}

// String names every field, for logs and test failures.
func (p *Pod) String() string {
	if p == nil {
		return "<nil>"
	}
	return fmt.Sprintf("name:%q namespace:%q uid:%q container_id:%q netns:%q interface:%q",
		p.Name, p.Namespace, p.Uid, p.ContainerId, p.Netns, p.Interface)
}

func (r *PodAddRequest) GetPod() *Pod {
	if r == nil {
		return nil
	}
	return r.Pod
}

func (r *PodAddRequest) GetIps() []string {
	if r == nil {
		return nil
	}
	return r.Ips
}

func (r *PodDelRequest) GetPod() *Pod {
	if r == nil {
		return nil
	}
	return r.Pod
}

func (r *PodAddResponse) GetEnrolled() bool { return r != nil && r.Enrolled }

func (r *PodAddResponse) GetReason() string {
	if r == nil {
		return ""
	}
	return r.Reason
}
