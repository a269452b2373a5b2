// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package plugin

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"
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
	p := podFromArgs("IgnoreUnknown=1;K8S_POD_NAMESPACE=demo;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5;junk", "abc", "/var/run/netns/x", "eth0")
	if p.GetName() != "web-0" || p.GetNamespace() != "demo" || p.GetUid() != "1234-5" || p.GetContainerId() != "abc" ||
		p.GetNetns() != "/var/run/netns/x" || p.GetInterface() != "eth0" {
		t.Errorf("pod = %v", p)
	}
}

// FuzzParseConfig: any stdin either parses into a config with a supported
// version, or fails with a CNI error; it never panics.
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
			if _, err := prevIPs(c.PrevResult); err != nil {
				return
			}
			if _, err := c.PrevResult.GetAsVersion(c.CNIVersion); err != nil {
				return
			}
		}
	})
}
