// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package deploy holds what an operator deploys: the Helm chart in
// ambient-ebpf/ and, at the repository root, the Dockerfile. Its tests
// render the chart with the Helm library and decode every object strictly
// into the Kubernetes API types we target, parse the agent's rendered
// arguments with the agent's own flags, run the agent's controller under
// the chart's RBAC against a real kube-apiserver (test/kubeapi, RBAC on),
// keep the Dockerfile's build targets in step with cmd/, and cross-compile
// them for every architecture the image is built for.
package deploy
