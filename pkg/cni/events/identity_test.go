// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package events

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/validate"
)

// quietServer is the server ServeListener registers, without its log.
func quietServer(h Handler) *server { return &server{h: h, log: slog.New(slog.DiscardHandler)} }

// withPod returns addReq's pod changed by edit.
func withPod(edit func(p *cniv1.Pod)) *cniv1.Pod {
	p := *addReq().GetPod()
	edit(&p)
	return &p
}

// Every identity in a request is checked before the handler sees it; a bad
// one is InvalidArgument naming the field and the value, over the socket as
// for a direct call.
func TestRequestsWithInvalidIdentitiesAreRefused(t *testing.T) {
	cases := []struct {
		name  string
		pod   *cniv1.Pod
		field string
	}{
		{"traversal pod name", withPod(func(p *cniv1.Pod) { p.Name = "../../links" }), "pod name"},
		{"traversal namespace", withPod(func(p *cniv1.Pod) { p.Namespace = "shop/../.." }), "pod namespace"},
		{"traversal uid", withPod(func(p *cniv1.Pod) { p.Uid = "../../links" }), "pod uid"},
		{"dot-dot uid", withPod(func(p *cniv1.Pod) { p.Uid = ".." }), "pod uid"},
		{"nul in name", withPod(func(p *cniv1.Pod) { p.Name = "web\x00" }), "pod name"},
		{"unicode namespace", withPod(func(p *cniv1.Pod) { p.Namespace = "démo" }), "pod namespace"},
		{"overlong name", withPod(func(p *cniv1.Pod) { p.Name = strings.Repeat("w", 254) }), "pod name"},
		{"overlong uid", withPod(func(p *cniv1.Pod) { p.Uid = strings.Repeat("u", 40) }), "pod uid"},
		{"container id", withPod(func(p *cniv1.Pod) { p.ContainerId = "c/../1" }), "container id"},
		{"interface", withPod(func(p *cniv1.Pod) { p.Interface = "eth0:1" }), "interface name"},
		{"relative netns", withPod(func(p *cniv1.Pod) { p.Netns = "run/netns/x" }), "netns path"},
		{"no pod at all", &cniv1.Pod{}, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := &fakeHandler{}
			srv := quietServer(h)
			_, addErr := srv.PodAdd(context.Background(), &cniv1.PodAddRequest{Pod: tc.pod, Ips: []string{"198.18.0.5"}})
			_, delErr := srv.PodDel(context.Background(), &cniv1.PodDelRequest{Pod: tc.pod})
			for op, err := range map[string]error{"add": addErr, "del": delErr} {
				if codeOf(err) != cniv1.CodeInvalidArgument || !strings.Contains(err.Error(), tc.field) {
					t.Errorf("%s = %v; want InvalidArgument naming %s", op, err, tc.field)
				}
			}
			if len(h.adds)+len(h.dels) != 0 {
				t.Errorf("handler saw adds %v, dels %v", h.adds, h.dels)
			}
		})
	}
	if _, err := quietServer(&fakeHandler{}).PodAdd(context.Background(), &cniv1.PodAddRequest{Pod: addReq().GetPod(), Ips: []string{"fe80::1%eth0"}}); codeOf(err) != cniv1.CodeInvalidArgument {
		t.Errorf("add with a zoned ip = %v; want InvalidArgument", err)
	}
}

// A DEL may come without the uid, and even without the names: the agent
// finds the pod by container id or netns.
func TestDelWithoutUIDReachesTheHandler(t *testing.T) {
	for _, p := range []*cniv1.Pod{
		withPod(func(p *cniv1.Pod) { p.Uid = "" }),
		{ContainerId: "c1"},
		{Netns: "/var/run/netns/x"},
	} {
		h := &fakeHandler{}
		if _, err := quietServer(h).PodDel(context.Background(), &cniv1.PodDelRequest{Pod: p}); err != nil || len(h.dels) != 1 {
			t.Errorf("PodDel(%v) = %v, handler saw %d", p, err, len(h.dels))
		}
	}
}

// Whatever a request holds, the server either refuses it with
// InvalidArgument or hands the handler a pod whose every identity passes
// pkg/validate, never a '/' or NUL in a name or uid.
func FuzzServerPodAddDel(f *testing.F) {
	p := addReq().GetPod()
	f.Add(p.Name, p.Namespace, p.Uid, p.ContainerId, p.Netns, p.Interface, "198.18.0.5")
	f.Add("../../links", "shop", "", "c1", "/var/run/netns/x", "eth0", "fd00:198:18::5")
	f.Add("web", "shop", "../../links", "", "", "", "")
	f.Add("", "", "", "c1", "", "", "1.2.3.4%x")
	f.Add("web\x00", "shop", "..", "c/1", "relative", "eth0/x", "::ffff:198.18.0.1")
	f.Fuzz(func(t *testing.T, name, namespace, uid, containerID, netns, iface, ip string) {
		h := &fakeHandler{}
		srv := quietServer(h)
		pod := &cniv1.Pod{Name: name, Namespace: namespace, Uid: uid, ContainerId: containerID, Netns: netns, Interface: iface}
		_, addErr := srv.PodAdd(context.Background(), &cniv1.PodAddRequest{Pod: pod, Ips: []string{ip}})
		_, delErr := srv.PodDel(context.Background(), &cniv1.PodDelRequest{Pod: pod})
		for _, err := range []error{addErr, delErr} {
			if err != nil && codeOf(err) != cniv1.CodeInvalidArgument {
				t.Fatalf("error %v; want InvalidArgument (the fake handler never fails)", err)
			}
		}
		var seen []*cniv1.Pod
		for _, r := range h.adds {
			seen = append(seen, r.GetPod())
			if validate.PodNames(r.GetPod().GetNamespace(), r.GetPod().GetName()) != nil || validate.NetnsPath(r.GetPod().GetNetns()) != nil {
				t.Fatalf("add reached the handler without valid names and netns: %v", r)
			}
		}
		for _, r := range h.dels {
			seen = append(seen, r.GetPod())
		}
		for _, p := range seen {
			for _, v := range []string{p.GetName(), p.GetNamespace(), p.GetUid(), p.GetContainerId(), p.GetInterface()} {
				if strings.ContainsAny(v, "/\x00") || v == "." || v == ".." {
					t.Fatalf("the handler got %q in %v", v, p)
				}
			}
			if p.GetUid() != "" && validate.PodUID(p.GetUid()) != nil {
				t.Fatalf("the handler got uid %q", p.GetUid())
			}
		}
	})
}
