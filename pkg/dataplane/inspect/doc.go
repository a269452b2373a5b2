// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package inspect reads a node's pinned data path, read-only and without
// the agent, for the CLI, doctor and the agent's inspection API: Pinned
// (pods, counters, every map decoded, listeners, each pod's hooks), Why
// (what the programs would do with a connection, hook by hook), Tracer
// (their decision events, one reader at a time), CgroupPrograms (who else
// is on the socket hooks), and the names of what they decide (Decision,
// Reason, Hook). The runtime, package dataplane, shares its pod records
// (ReadPods, EnrolledPod, Options, Stats) and trace flag; imports run
// dataplane -> inspect -> bpfobj.
package inspect
