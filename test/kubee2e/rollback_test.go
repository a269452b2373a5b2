// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package kubee2e

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/test/agentrun"
	"github.com/ambient-ebpf/ambient-ebpf/test/simnode"
)

// v0.1.0 re-applies, at each start, every pod in the mesh with the
// options it decides for it without the pod's namespace: a pod in the
// mesh by its namespace's label alone loses DNS capture (its DNS goes
// around ztunnel; its TCP does not), a pod labelled itself keeps it. HEAD,
// started again, restores it. The chaos soak found it (test/soak, fault
// release_switch); the README's rollback note says so.
func TestUpgradeFromTheLastReleaseRestoresDNSCapture(t *testing.T) {
	c := requireCluster(t)
	ns := c.Namespace(t, "rollback", ambientLabels)
	r := newAgentRun(t, c, ns.Name)
	// While the DaemonSet exists, a stop keeps the node's state (a
	// rolling update).
	c.DaemonSet(t, ns.Name, "ambient-ebpf")
	byNS, byNSNode := r.pod("byns", true, nil)
	own, ownNode := r.pod("own", true, nil)
	patchLabels(t, own, map[string]any{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient})
	apps := map[string]*simnode.App{byNS.Name: r.StartApp(byNSNode), own.Name: r.StartApp(ownNode)}
	out := r.StartOutsideApp()
	if _, err := out.Do(simnode.AppRequest{Op: "dns-server", Addr: netip.AddrPortFrom(netip.IPv6Unspecified(), 53), Answer: simnode.OutsideDNSAnswer}); err != nil {
		t.Fatal(err)
	}
	r.StartZtunnelFor(r.ZDS)

	query := 0
	answer := func(pod string) netip.Addr {
		query++
		resp, err := apps[pod].Do(simnode.AppRequest{Op: "dns", Addr: netip.AddrPortFrom(simnode.OutsideV4, 53),
			DNSName: fmt.Sprintf("q%d.%s", query, simnode.KnownDNSSuffix), Proto: "udp"})
		if err != nil {
			return netip.Addr{}
		}
		return resp.Answer
	}
	capture := func(pod string) bool { return r.DNSCapture()[ns.Name+"/"+pod] }
	captured := func(pod string) bool { return capture(pod) && answer(pod) == simnode.KnownDNSAnswer }

	// HEAD with the values the README says to set before a rollback.
	head, headPlugin := r.Bin, r.Plugin
	r.start("--pods-cgroup=none", "--host-probes=snat")
	r.waitFor("both pods' DNS answered by ztunnel under HEAD", func() bool { return captured(byNS.Name) && captured(own.Name) })

	rel := agentrun.LastRelease(t)
	if err := r.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	r.Bin, r.Plugin, r.Omit = rel.Agent, rel.Plugin, rel.Omit
	r.start()
	if rel.Version == "v0.1.0" {
		r.waitFor("v0.1.0 to re-apply the pod in the mesh by its namespace with DNS capture off", func() bool {
			return !capture(byNS.Name) && answer(byNS.Name) == simnode.OutsideDNSAnswer
		})
	} else {
		r.waitFor(rel.Version+" to keep DNS capture", func() bool { return captured(byNS.Name) })
	}
	if !captured(own.Name) {
		t.Errorf("under %s, the pod labelled itself lost DNS capture", rel.Version)
	}

	if err := r.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	r.Bin, r.Plugin, r.Omit = head, headPlugin, nil
	r.start()
	r.waitFor("HEAD to restore DNS capture of every pod", func() bool { return captured(byNS.Name) && captured(own.Name) })
}
