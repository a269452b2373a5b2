// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocnireal

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// The documented install (profile=ambient) gives install-cni ambient mode,
// its own pod's identity through the downward API, and the host-netns
// switch; limits are not set, so GOMEMLIMIT and GOMAXPROCS are left out.
func TestChartContainerOfTheAmbientProfile(t *testing.T) {
	ch, err := RenderChart(AmbientProfile)
	if err != nil {
		t.Fatal(err)
	}
	env, args, err := ch.Container(Pod{NodeName: "node-a", Name: "istio-cni-node-x", Namespace: ReleaseNamespace})
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]string{
		"AMBIENT_ENABLED": "true", "AMBIENT_DNS_CAPTURE": "true", "AMBIENT_IPV6": "true", "ALLOW_SWITCH_TO_HOST_NS": "true",
		"NODE_NAME": "node-a", "REPAIR_NODE_NAME": "node-a", "POD_NAME": "istio-cni-node-x", "POD_NAMESPACE": ReleaseNamespace,
		"EXCLUDE_NAMESPACES": "kube-system", "CHAINED_CNI_PLUGIN": "true", "NATIVE_NFTABLES": "false",
	} {
		if env[k] != want {
			t.Errorf("%s=%q, want %q", k, env[k], want)
		}
	}
	for _, k := range []string{"GOMEMLIMIT", "GOMAXPROCS"} {
		if _, ok := env[k]; ok {
			t.Errorf("%s set without a limit", k)
		}
	}
	if !strings.Contains(env["AMBIENT_ENABLEMENT_SELECTOR"], "istio.io/dataplane-mode") {
		t.Errorf("AMBIENT_ENABLEMENT_SELECTOR=%q", env["AMBIENT_ENABLEMENT_SELECTOR"])
	}
	t.Logf("args %q", args)
}

// A mount the harness does not provide fails rather than being left out.
func TestChartContainerRefusesAMountNotProvided(t *testing.T) {
	ch, err := RenderChart(AmbientProfile)
	if err != nil {
		t.Fatal(err)
	}
	c := &ch.DaemonSet.Spec.Template.Spec.Containers[0]
	c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: "extra", MountPath: "/host/var/lib/kubelet"})
	if _, _, err := ch.Container(Pod{}); err == nil || !strings.Contains(err.Error(), "/host/var/lib/kubelet") {
		t.Fatalf("Container: %v", err)
	}
}
