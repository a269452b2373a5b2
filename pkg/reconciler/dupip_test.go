// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package reconciler

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/inspect"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
)

// A pod adopted without addresses (an agent before the duplicate-IP
// refusal let a duplicate's removal take them from its pins) takes them
// from its source: an update of its options enrolls it with them, where it
// used to fail with "no IPs" on every retry, for good.
func TestAdoptedPodWithoutIPsTakesThemFromItsSource(t *testing.T) {
	e := newTestEnv(t, 1)
	e.dp.pinned = []inspect.EnrolledPod{{UID: string(e.web.UID), Namespace: e.web.Namespace, Name: e.web.Name,
		Interface: "eth0", Options: podopts.Options{DNSCapture: true}}}
	e.r.Adopt(context.Background(), nil)
	p := e.web.DeepCopy()
	p.Annotations = map[string]string{enrollment.BypassInboundAnnotation: "true"}
	if err := e.liveAdd(t, p); err != nil {
		t.Fatalf("options update of the adopted pod: %v", err)
	}
	want := []netip.Addr{netip.MustParseAddr(e.web.Status.PodIP)}
	if len(e.dp.enrolls) != 1 || !slices.Equal(e.dp.enrolls[0].IPs, want) || !e.dp.enrolls[0].Options.BypassInbound {
		t.Errorf("Enroll calls %+v, want one with the source's addresses %v and the new options", e.dp.enrolls, want)
	}
}

// An adopted pod the data path reports with a problem (an address whose
// entry it could not restore) is enrolled again in place at adoption,
// with its addresses and options, before anything else.
func TestAdoptedPodWithAProblemIsEnrolledAgain(t *testing.T) {
	e := newTestEnv(t, 1)
	ips := []netip.Addr{netip.MustParseAddr("198.18.0.10"), netip.MustParseAddr("fd00:198:18::a")}
	e.dp.pinned = []inspect.EnrolledPod{
		{UID: "uid-lost", Namespace: "shop", Name: "lost", Interface: "eth0", IPs: ips, Options: podopts.Options{DNSCapture: true},
			Problem: "no ae_pods entry for 198.18.0.10: inbound traffic to it is not captured"},
		{UID: "uid-fine", Namespace: "shop", Name: "fine", Interface: "eth0", IPs: ips[:1]},
	}
	e.r.Adopt(context.Background(), nil)
	if len(e.dp.enrolls) != 1 {
		t.Fatalf("Enroll calls %+v, want one, of the pod with a problem", e.dp.enrolls)
	}
	got := e.dp.enrolls[0]
	if got.UID != "uid-lost" || !slices.Equal(got.IPs, ips) || !got.Options.DNSCapture || !got.Running || got.Netns != "/proc/1/ns/net" {
		t.Errorf("Enroll(%+v), want pod lost in place with its addresses and options", got)
	}
}

// Two pods of the source with one address: the data path refuses the
// second (dataplane.ErrDuplicateIP) while the first has it; the second is
// reported as a failed repair with that error, and retried.
func TestDuplicateIPRefusalIsReportedAndRetried(t *testing.T) {
	e := newTestEnv(t, 1)
	e.dp.fail = fmt.Errorf("pod shop/web: %w: 198.18.0.10 is pod shop/other's", dataplane.ErrDuplicateIP)
	err := e.liveAdd(t, e.web)
	if !errors.Is(err, dataplane.ErrDuplicateIP) {
		t.Fatalf("reconcile: %v, want ErrDuplicateIP (retried)", err)
	}
	if c, ok := e.chg.last(e.web.UID); !ok || c.Repair != RepairFailed || !errors.Is(c.Err, dataplane.ErrDuplicateIP) || c.Redirection != enrollment.RedirectionNone {
		t.Errorf("published %+v, want a failed repair with ErrDuplicateIP, not redirected", c)
	}
	e.dp.fail = nil
	if err := e.liveAdd(t, e.web); err != nil || !e.dp.has(string(e.web.UID)) {
		t.Errorf("retry once the address is free: %v, enrolled %v", err, e.dp.has(string(e.web.UID)))
	}
}
