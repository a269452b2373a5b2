// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package takeover

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/istiocni"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/reconciler"
)

// fakes records every call in order, and answers from its fields.
type fakes struct {
	mu      sync.Mutex
	calls   []string
	pod     *istiocni.Pod
	node    *istiocni.Node
	drained bool // Has answers it
	flows   []int
}

func (f *fakes) call(c string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, c)
}

func (f *fakes) InspectPod(context.Context, string) (*istiocni.Pod, error) {
	f.call("inspect-pod")
	return f.pod, nil
}
func (f *fakes) RemovePod(_ context.Context, _ string, o istiocni.RemoveOptions) error {
	if !o.KeepReturnPath {
		f.call("remove-pod-and-return-path")
	} else {
		f.call("remove-pod")
	}
	return nil
}
func (f *fakes) InspectNode(context.Context, string) (*istiocni.Node, error) {
	f.call("inspect-node")
	return f.node, nil
}
func (f *fakes) RemoveNode(context.Context, string) error { f.call("remove-node"); return nil }
func (f *fakes) RemoveProbeEntries(context.Context, string, string, []netip.Addr) error {
	f.call("remove-probe-entries")
	return nil
}
func (f *fakes) Missing() []string { return nil }

func (f *fakes) Install(context.Context, string) error { f.call("install-drain"); return nil }
func (f *fakes) Remove(context.Context, string) error  { f.call("remove-drain"); return nil }
func (f *fakes) Has(context.Context, string) (bool, error) {
	f.call("has-drain")
	return f.drained, nil
}
func (f *fakes) Flows(context.Context, string) (int, error) {
	f.call("flows")
	n := 0
	if len(f.flows) > 0 {
		n, f.flows = f.flows[0], f.flows[1:]
	}
	return n, nil
}

func newTakeover(t *testing.T, f *fakes, results *[]string) *Takeover {
	t.Helper()
	tk, err := New(Config{Rules: f, Drain: f, NodeNetns: "/proc/self/ns/net", Logger: slog.New(slog.DiscardHandler),
		OnResult: func(r string) { *results = append(*results, r) }})
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

var pod = reconciler.TakeoverPod{UID: "uid-web", Namespace: "shop", Name: "web", Netns: "/run/netns/web"}

func exact() *istiocni.Pod {
	return &istiocni.Pod{Iptables: []istiocni.IptablesRules{{Backend: istiocni.NftCompat, Family: "ipv4", Exact: true}},
		Rule4: true, Route4: true, Equivalent: true}
}

func TestInspect(t *testing.T) {
	for _, tc := range []struct {
		name    string
		f       *fakes
		pinned  bool
		want    reconciler.TakeoverAction
		results []string
	}{
		{name: "nothing", f: &fakes{pod: &istiocni.Pod{}}, want: reconciler.TakeoverNone},
		{name: "only the return path (ours)", f: &fakes{pod: &istiocni.Pod{Rule4: true, Route4: true, Reasons: []string{"return path without rules"}}}, want: reconciler.TakeoverNone},
		{name: "exact", f: &fakes{pod: exact()}, want: reconciler.TakeoverProceed},
		{name: "hand-edited", f: &fakes{pod: &istiocni.Pod{Iptables: []istiocni.IptablesRules{{Backend: istiocni.Legacy}}, Reasons: []string{"not the rules istio-cni writes"}}},
			want: reconciler.TakeoverRefused, results: []string{ResultRefused}},
		{name: "begun before a crash", f: &fakes{drained: true, pod: &istiocni.Pod{Iptables: []istiocni.IptablesRules{{Backend: istiocni.Legacy}}}}, want: reconciler.TakeoverProceed},
		{name: "pinned, no drain: not inspected", f: &fakes{}, pinned: true, want: reconciler.TakeoverNone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var results []string
			tk := newTakeover(t, tc.f, &results)
			p := pod
			p.Pinned = tc.pinned
			plan, err := tk.Inspect(context.Background(), p)
			if err != nil || plan.Action != tc.want || !slices.Equal(results, tc.results) {
				t.Errorf("Inspect = %+v, %v, results %v; want %v, %v", plan, err, results, tc.want, tc.results)
			}
			if tc.want == reconciler.TakeoverRefused && plan.Reason == "" {
				t.Error("refused without a reason")
			}
		})
	}
}

// The drain goes in before istio-cni's rules go, the return path stays,
// the node's rule goes only once its sets are empty, and the drain goes
// once no redirected flow is left.
func TestFinishOrder(t *testing.T) {
	var results []string
	f := &fakes{pod: exact(), node: &istiocni.Node{IPSets: map[string]int{istiocni.ProbeSetV4: 0}}, flows: []int{2, 0}}
	tk := newTakeover(t, f, &results)
	ctx := context.Background()
	if _, err := tk.Inspect(ctx, pod); err != nil {
		t.Fatal(err)
	}
	draining, err := tk.Finish(ctx, pod)
	if err != nil || !draining {
		t.Fatalf("first Finish = %v, %v; want draining", draining, err)
	}
	if s := tk.States(); len(s) != 1 || s[0].Phase != PhaseDraining || s[0].Flows != 2 {
		t.Errorf("states %+v", s)
	}
	draining, err = tk.Finish(ctx, pod)
	if err != nil || draining {
		t.Fatalf("second Finish = %v, %v; want done", draining, err)
	}
	want := []string{"has-drain", "inspect-pod", "install-drain", "remove-pod", "remove-probe-entries", "inspect-node", "remove-node", "flows", "flows", "remove-drain"}
	if !slices.Equal(f.calls, want) {
		t.Errorf("calls\n%v\nwant\n%v", f.calls, want)
	}
	if !slices.Equal(results, []string{ResultTakenOver}) {
		t.Errorf("results %v", results)
	}
	if s := tk.States(); s[0].Phase != PhaseTakenOver {
		t.Errorf("states %+v", s)
	}
}

// Another pod still in istio-cni's probe sets keeps the node's rule.
func TestFinishKeepsTheNodeRuleWhileAPodNeedsIt(t *testing.T) {
	var results []string
	f := &fakes{pod: exact(), node: &istiocni.Node{IPSets: map[string]int{istiocni.ProbeSetV4: 1}}}
	tk := newTakeover(t, f, &results)
	ctx := context.Background()
	if _, err := tk.Inspect(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if _, err := tk.Finish(ctx, pod); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(f.calls, "remove-node") {
		t.Errorf("the node rule went while a pod is in its sets: %v", f.calls)
	}
}
