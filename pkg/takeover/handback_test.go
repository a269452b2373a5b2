// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/podopts"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

type fakeWriter struct {
	calls   []string
	failPod string // ApplyPod fails in this netns
	opts    map[string]podopts.Options
}

func (w *fakeWriter) ApplyPod(_ context.Context, path string, b istiocni.Backend, o podopts.Options) error {
	w.calls = append(w.calls, "pod "+path+" "+string(b))
	if path == w.failPod {
		return errors.New("iptables-nft-restore: exit status 1")
	}
	w.opts[path] = o
	return nil
}
func (w *fakeWriter) ApplyNode(_ context.Context, path string, b istiocni.Backend) error {
	w.calls = append(w.calls, "node "+path+" "+string(b))
	return nil
}
func (w *fakeWriter) AddProbeEntries(_ context.Context, path, uid string, _ []netip.Addr) error {
	w.calls = append(w.calls, "probes "+uid)
	return nil
}

// The node's rule goes in first, then each pod's rules and probe entries
// with its options; a pod that fails is not handed back (it stays on
// eBPF), one istio-cni already redirects is, untouched.
func TestHandBack(t *testing.T) {
	w := &fakeWriter{failPod: "/ns/b", opts: map[string]podopts.Options{}}
	pods := []reconciler.Pod{
		{UID: "a", Namespace: "ns", Name: "a", Netns: "/ns/a", Options: podopts.Options{DNSCapture: true, RerouteInterfaces: []string{"wg0"}}},
		{UID: "b", Namespace: "ns", Name: "b", Netns: "/ns/b"},
		{UID: "c", Namespace: "ns", Name: "c", IstioCNI: true},
		{UID: "d", Namespace: "ns", Name: "d"}, // netns not known
	}
	var results []string
	drain := &fakes{}
	handed, err := HandBack(context.Background(), w, drain, "/node", istiocni.NftCompat, pods, slog.New(slog.DiscardHandler), func(r string) { results = append(results, r) })
	if err == nil || !strings.Contains(err.Error(), "ns/b") || !strings.Contains(err.Error(), "ns/d") {
		t.Errorf("error %v, want ns/b's and ns/d's failures", err)
	}
	if !slices.Equal(handed, []string{"a", "c"}) {
		t.Errorf("handed back %v, want a and c", handed)
	}
	want := []string{"node /node iptables-nft", "pod /ns/a iptables-nft", "probes a", "pod /ns/b iptables-nft"}
	if !slices.Equal(w.calls, want) {
		t.Errorf("calls %v, want %v", w.calls, want)
	}
	if !slices.Equal(drain.calls, []string{"remove-drain"}) {
		t.Errorf("drain calls %v, want a's drain removed", drain.calls)
	}
	if o := w.opts["/ns/a"]; !o.DNSCapture || o.BypassInbound || !slices.Equal(o.RerouteInterfaces, []string{"wg0"}) {
		t.Errorf("options of a: %+v", o)
	}
	if !slices.Equal(results, []string{ResultHandedBack, ResultHandFailed, ResultHandFailed}) {
		t.Errorf("results %v", results)
	}
}
