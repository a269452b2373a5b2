// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package accel is the optional sockmap acceleration (bpf/accel.c, the
// agent's --sockmap-accel, Linux 5.15): a sockops program on the node's
// cgroup root puts both ends of each pod-local app <-> ztunnel connection
// into sockhashes, and an sk_msg program queues a send straight onto the
// peer socket, without TCP on that hop. The runtime (package dataplane)
// calls Setup at its start and Uninstall with its own; the CLI and doctor
// call Read. It adds to the pinned layout:
//
//	maps/ae_accel        ends whose sends are redirected (sockhash, by cookie)
//	maps/ae_accel_rx     ends that are redirected to (sockhash, by cookie)
//	maps/ae_accel_pair   connections by their connecting end's 4-tuple:
//	                     who the two ends are
//	maps/ae_accel_sk     each end's cookie, peer and decision (socket storage)
//	maps/ae_accel_stats  its counters (per CPU)
//	links/accel_sockops  the sockops program that fills ae_accel, on the
//	                     node's cgroup root beside links/sockops
//	links/accel_msg      the sk_msg program on ae_accel (Linux 6.10+; before,
//	                     the program is attached to the map itself, which
//	                     holds it as long as the pinned map lives)
//
// Turning the flag off removes links/accel_sockops, so no new hop is
// accelerated (and the connections still open leave their ae_accel_pair
// entries behind: their close no longer runs the program; the entries go
// with the maps). Sockets already in ae_accel keep their program until they
// close: taking a socket out of a sockhash would drop what was redirected
// to it and not yet read. The map and the program go once it is empty
// (checked at each start with the flag off).
package accel
