// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/cni/fallback/decide"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
)

const prev100 = `{"cniVersion":"1.0.0","interfaces":[{"name":"veth1","mac":"aa:bb:cc:dd:ee:01"},{"name":"eth0","mac":"aa:bb:cc:dd:ee:02","sandbox":"/var/run/netns/p"}],` +
	`"ips":[{"address":"198.18.0.1/24","interface":0},{"address":"198.18.0.5/24","interface":1},{"address":"fd00:198:18::5/64","interface":1}]}`

func conf(version, prev, extra string) []byte {
	s := `{"cniVersion":"` + version + `","name":"k8s","type":"ambient-ebpf-cni"` + extra
	if prev != "" {
		s += `,"prevResult":` + prev
	}
	return []byte(s + "}")
}

func TestParseConfigRejectsMalformedInputWithCNIErrorCodes(t *testing.T) {
	cases := []struct {
		name  string
		stdin []byte
		code  uint
	}{
		{"not json", []byte("{nope"), types.ErrDecodingFailure},
		{"empty", nil, types.ErrDecodingFailure},
		{"json array", []byte("[]"), types.ErrDecodingFailure},
		{"no cniVersion", []byte(`{"name":"k8s","type":"ambient-ebpf-cni"}`), types.ErrIncompatibleCNIVersion},
		{"unknown cniVersion", conf("9.9.9", "", ""), types.ErrIncompatibleCNIVersion},
		{"too old cniVersion", conf("0.2.0", "", ""), types.ErrIncompatibleCNIVersion},
		{"prevResult not an object", conf("1.0.0", `"x"`, ""), types.ErrDecodingFailure},
		{"prevResult bad address", conf("1.0.0", `{"cniVersion":"1.0.0","ips":[{"address":"nope"}]}`, ""), types.ErrDecodingFailure},
		{"bad agentTimeout", conf("1.0.0", prev100, `,"agentTimeout":"soon"`), types.ErrInvalidNetworkConfig},
		{"negative agentTimeout", conf("1.0.0", prev100, `,"agentTimeout":"-1s"`), types.ErrInvalidNetworkConfig},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseConfig(tc.stdin)
			var cniErr *types.Error
			if !errors.As(err, &cniErr) {
				t.Fatalf("ParseConfig error = %v (%T), want a *types.Error", err, err)
			}
			if cniErr.Code != tc.code {
				t.Errorf("code = %d (%s), want %d", cniErr.Code, cniErr.Msg, tc.code)
			}
		})
	}
}

func TestParseConfigDefaultsAndPrevResultAcrossVersions(t *testing.T) {
	prev031 := `{"cniVersion":"0.3.1","interfaces":[{"name":"eth0","sandbox":"/var/run/netns/p"}],"ips":[{"version":"4","address":"198.18.0.7/24","interface":0}]}`
	cases := []struct {
		version, prev string
		wantIPs       []string
	}{
		{"0.3.1", prev031, []string{"198.18.0.7"}},
		{"0.4.0", `{"cniVersion":"0.4.0","ips":[{"version":"4","address":"198.18.0.8/24"}]}`, []string{"198.18.0.8"}},
		{"1.0.0", prev100, []string{"198.18.0.5", "fd00:198:18::5"}},
		{"1.1.0", prev100, []string{"198.18.0.5", "fd00:198:18::5"}},
	}
	for _, tc := range cases {
		t.Run(tc.version, func(t *testing.T) {
			c, err := ParseConfig(conf(tc.version, tc.prev, ""))
			if err != nil {
				t.Fatal(err)
			}
			if c.AgentSocket == "" || c.agentTimeout != DefaultAgentTimeout || !slices.Equal(c.ExcludeNamespaces, []string{"kube-system"}) {
				t.Errorf("defaults not applied: %+v", c)
			}
			ips, err := prevIPs(c.PrevResult)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(ips, tc.wantIPs) {
				t.Errorf("ips = %v, want %v (host-side addresses excluded)", ips, tc.wantIPs)
			}
		})
	}
	c, err := ParseConfig(conf("1.0.0", "", `,"agentTimeout":"250ms","excludeNamespaces":["infra"]`))
	if err != nil {
		t.Fatal(err)
	}
	if c.agentTimeout != 250*time.Millisecond || !slices.Equal(c.ExcludeNamespaces, []string{"infra"}) || c.PrevResult != nil {
		t.Errorf("explicit settings not kept: %+v", c)
	}
}

func TestPodFromArgs(t *testing.T) {
	args := &skel.CmdArgs{ContainerID: "abc", Netns: "/var/run/netns/x", IfName: "eth0",
		Args: "IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5;junk"}
	p, ok, err := podFromArgs(args, true)
	if err != nil || !ok || p.GetName() != "web-0" || p.GetNamespace() != "demo" || p.GetUid() != "1234-5" || p.GetContainerId() != "abc" ||
		p.GetNetns() != "/var/run/netns/x" || p.GetInterface() != "eth0" {
		t.Errorf("pod = %v, %v, %v", p, ok, err)
	}
	if _, ok, err := podFromArgs(&skel.CmdArgs{Args: "IgnoreUnknown=1", ContainerID: "abc", IfName: "eth0"}, true); ok || err != nil {
		t.Errorf("CNI_ARGS without a pod: %v, %v", ok, err)
	}
	// DEL may come without a netns.
	args.Netns = ""
	if _, ok, err := podFromArgs(args, false); !ok || err != nil {
		t.Errorf("DEL without a netns: %v, %v", ok, err)
	}
}

// Every identity the runtime hands over is checked; a bad one is a CNI
// error 4 that names the field and the value.
func TestPodFromArgsRefusesInvalidIdentities(t *testing.T) {
	valid := skel.CmdArgs{ContainerID: "abc", Netns: "/var/run/netns/x", IfName: "eth0"}
	pod := func(ns, name, uid string) string {
		return "K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=" + uid
	}
	cases := []struct {
		name, field string
		edit        func(a *skel.CmdArgs)
	}{
		{"traversal name", "pod name", func(a *skel.CmdArgs) { a.Args = pod("shop", "../../links", "u") }},
		{"traversal namespace", "pod namespace", func(a *skel.CmdArgs) { a.Args = pod("shop/..", "web", "u") }},
		{"traversal uid", "pod uid", func(a *skel.CmdArgs) { a.Args = pod("shop", "web", "../../links") }},
		{"dot uid", "pod uid", func(a *skel.CmdArgs) { a.Args = pod("shop", "web", "..") }},
		{"nul in name", "pod name", func(a *skel.CmdArgs) { a.Args = pod("shop", "web\x00", "u") }},
		{"unicode name", "pod name", func(a *skel.CmdArgs) { a.Args = pod("shop", "wéb", "u") }},
		{"overlong name", "pod name", func(a *skel.CmdArgs) { a.Args = pod("shop", strings.Repeat("a", 254), "u") }},
		{"overlong uid", "pod uid", func(a *skel.CmdArgs) { a.Args = pod("shop", "web", strings.Repeat("u", 40)) }},
		{"name without namespace", "pod namespace", func(a *skel.CmdArgs) { a.Args = "K8S_POD_NAME=web" }},
		{"name given twice", "K8S_POD_NAME given twice", func(a *skel.CmdArgs) { a.Args = pod("shop", "web", "u") + ";K8S_POD_NAME=other" }},
		{"bad infra container id", "infra container id", func(a *skel.CmdArgs) { a.Args = pod("shop", "web", "u") + ";K8S_POD_INFRA_CONTAINER_ID=../x" }},
		{"bad container id", "container id", func(a *skel.CmdArgs) { a.ContainerID = "../x" }},
		{"empty container id", "container id", func(a *skel.CmdArgs) { a.ContainerID = "" }},
		{"bad interface", "interface name", func(a *skel.CmdArgs) { a.IfName = "../eth0" }},
		{"overlong interface", "interface name", func(a *skel.CmdArgs) { a.IfName = "eth0123456789abc" }},
		{"relative netns", "netns path", func(a *skel.CmdArgs) { a.Netns = "netns/x" }},
		{"nul in netns", "netns path", func(a *skel.CmdArgs) { a.Netns = "/var/run/netns/x\x00" }},
		{"no netns on add", "netns path", func(a *skel.CmdArgs) { a.Netns = "" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := valid
			a.Args = pod("shop", "web", "u")
			tc.edit(&a)
			_, ok, err := podFromArgs(&a, true)
			var cniErr *types.Error
			if ok || !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidEnvironmentVariables || !strings.Contains(cniErr.Msg, tc.field) {
				t.Errorf("podFromArgs = %v, %v; want code 4 naming %s", ok, err, tc.field)
			}
		})
	}
}

// Whatever CNI_ARGS and the CNI environment hold, an accepted pod carries
// only identities that are one path element without NUL, and parsing is
// stable: the accepted pod's own CNI_ARGS give the same pod back.
func FuzzCNIArgs(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-0;K8S_POD_UID=1234-5", "abc", "/var/run/netns/x", "eth0", true)
	f.Add("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=../../links;K8S_POD_UID=u", "abc", "/var/run/netns/x", "eth0", true)
	f.Add("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_UID=../../links", "abc", "", "eth0", false)
	f.Add("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_NAME=web", "abc", "/x", "eth0", true)
	f.Add(" K8S_POD_NAMESPACE =a;=;;K8S_POD_NAME==b", "a..", "/proc/1/ns/net", "eth0:1", false)
	f.Add("K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web\x00", "abc", "/x", "e\x00", true)
	f.Fuzz(func(t *testing.T, cniArgs, containerID, netns, ifName string, add bool) {
		args := &skel.CmdArgs{Args: cniArgs, ContainerID: containerID, Netns: netns, IfName: ifName}
		p, ok, err := podFromArgs(args, add)
		if err != nil {
			var cniErr *types.Error
			if ok || !errors.As(err, &cniErr) || cniErr.Code != types.ErrInvalidEnvironmentVariables {
				t.Fatalf("error %v (ok %v); want a CNI error 4", err, ok)
			}
			return
		}
		if !ok {
			return
		}
		for _, v := range []string{p.GetNamespace(), p.GetName(), p.GetUid(), p.GetContainerId(), p.GetInterface()} {
			if strings.ContainsAny(v, "/\x00") || v == "." || v == ".." {
				t.Fatalf("accepted %q in pod %v", v, p)
			}
		}
		if strings.IndexByte(p.GetNetns(), 0) >= 0 || add && !strings.HasPrefix(p.GetNetns(), "/") {
			t.Fatalf("accepted netns %q", p.GetNetns())
		}
		again := *args
		again.Args = "K8S_POD_NAMESPACE=" + p.GetNamespace() + ";K8S_POD_NAME=" + p.GetName() + ";K8S_POD_UID=" + p.GetUid()
		q, ok, err := podFromArgs(&again, add)
		if err != nil || !ok || q.String() != p.String() {
			t.Fatalf("re-parsing the accepted pod %v gave %v, %v, %v", p, q, ok, err)
		}
	})
}

// FuzzParseConfig: any stdin either parses into a config with a supported
// version, or fails with a CNI error; it never panics. The addresses read
// from an accepted prevResult are canonical IPs without a zone, which is
// what the agent parses.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(conf("1.0.0", prev100, "")))
	f.Add([]byte(conf("0.3.1", `{"cniVersion":"0.3.1","ips":[{"version":"4","address":"198.18.0.7/24","interface":0}]}`, "")))
	f.Add([]byte(conf("1.1.0", "", `,"agentTimeout":"1s","podFile":"/x","excludeNamespaces":[]`)))
	f.Add([]byte(conf("0.4.0", `{"ips":[{"address":"fd00:198:18::1/64","interface":-3}]}`, "")))
	f.Add([]byte(`{"cniVersion":"1.0.0","prevResult":{"interfaces":[{"name":"eth0"}],"ips":[{"address":"198.18.0.1/32","interface":7}]}}`))
	f.Add([]byte("{"))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, stdin []byte) {
		c, err := ParseConfig(stdin)
		if err != nil {
			var cniErr *types.Error
			if !errors.As(err, &cniErr) {
				t.Fatalf("error %v is not a *types.Error", err)
			}
			return
		}
		if !slices.Contains(SupportedVersions(), c.CNIVersion) || c.agentTimeout <= 0 || c.AgentSocket == "" {
			t.Fatalf("accepted an invalid config: %+v", c)
		}
		if c.PrevResult != nil {
			ips, err := prevIPs(c.PrevResult)
			if err != nil {
				return
			}
			for _, s := range ips {
				a, err := netip.ParseAddr(s)
				if err != nil || a.Zone() != "" || a.Is4In6() || a.String() != s {
					t.Fatalf("prevResult address %q: %v", s, err)
				}
			}
			if _, err := c.PrevResult.GetAsVersion(c.CNIVersion); err != nil {
				return
			}
		}
	})
}

// The agent's enablement selectors in the conflist entry decide the
// fallback as they decide in the agent.
func TestEnablementSelectorsDecideTheFallback(t *testing.T) {
	c, err := ParseConfig(conf("1.0.0", "", `,"enablementSelectors":[{"podSelector":{"matchLabels":{"mesh":"yes"}}}]`))
	if err != nil {
		t.Fatal(err)
	}
	src := &fakeSource{pods: map[string]*corev1.Pod{
		"shop/web": {ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "web", Labels: map[string]string{"mesh": "yes"}}},
		"shop/api": {ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: "api",
			Labels: map[string]string{enrollment.DataplaneModeLabel: enrollment.DataplaneModeAmbient}}},
	}}
	decideFor := inProcessFallback(func(*Config) decide.PodSource { return src })
	if d, err := decideFor(c, &cniv1.Pod{Namespace: "shop", Name: "web"}); err != nil || !d.Ambient || d.Reason != string(enrollment.ReasonSelected) {
		t.Errorf("fallback decision %+v, %v, want ambient by the selector", d, err)
	}
	if d, err := decideFor(c, &cniv1.Pod{Namespace: "shop", Name: "api"}); err != nil || d.Ambient {
		t.Errorf("fallback decision %+v, %v for a pod no selector matches", d, err)
	}
}
