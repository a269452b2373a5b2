// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package istiocnireal runs the real istio-cni on a simulated node
// (test/simnode), as users run it in ambient in-pod mode: Istio's node
// agent install-cni and its chained plugin istio-cni, built by `make
// istio-cni-bins` from go.mod's istio.io/istio into .cache/istio-cni/<version>
// (FindBinaries refuses a build of another version, naming both).
//
// Runtime is the container runtime's side: the host's CNI folders with the
// primary network (ptp + host-local), a netns folder of its own, and ADD
// and DEL through libcni in the node netns. RenderChart renders Istio's
// own istio-cni chart (profile=ambient by default) and Chart.Container
// gives the install-cni container's environment and arguments. Start runs
// install-cni with them in the node netns, in a mount namespace of its own
// (a tmpfs root with the machine's /usr, /etc, /tmp and the DaemonSet's
// /host mounts of the runtime's folders, in-cluster credentials of
// test/kubeapi's API server relayed into the node netns) and in the node's
// PID namespace (StartPIDNamespace; without one, a PID namespace of its
// own), whose /proc is its /host/proc: pause processes started there are
// how it finds pods' netns after a restart. Its ZDS socket is where the
// caller's ztunnel stand-in connects. It is stopped by PID; Agent.Restart
// stops it as a rolling update does and starts it again. Everything it
// made goes with t's cleanup. StartNode does all of that on a fresh node,
// up to the caller's ZDS peer connected (test/differential, and
// test/bench's enrolment and scale figures).
package istiocnireal
