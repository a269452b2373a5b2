// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package kube is the node agent's Kubernetes side (contract sections 5
// and 6), in two parts that never decide anything themselves:
//
//   - Controller, a source: informers on the pods of this node and on all
//     namespaces report each pod, with its namespace, to the reconciler
//     (pkg/reconciler), and Lookup reads a pod for a CNI ADD.
//   - StatusWriter, a listener: it takes the reconciler's Changes and
//     writes them to the API server: the ambient.istio.io/redirection
//     annotation through pods/status, Events, and the repair of running
//     ambient pods the data path does not redirect (RepairConfig: delete
//     or label them; in place is the reconciler's).
//
// Start-up follows the contract's order and the agent drives it:
//
//	c, err := kube.New(cfg, client)  // no I/O
//	err = c.Start(ctx)               // informers running, caches synced
//	snap, err := c.Snapshot()        // pods annotated enabled on this node
//	rec.Adopt(ctx, snap)             // the data path adopted
//	go w.Run(ctx); go rec.Run(ctx)   // status writer, reconciler
//	go c.Run(ctx, rec)               // handlers until ctx ends
package kube
