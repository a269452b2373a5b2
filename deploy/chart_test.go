// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"fmt"
	"net"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

func clusterRules(podVerbs ...string) []rbacv1.PolicyRule {
	return []rbacv1.PolicyRule{
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: append([]string{"get", "list", "watch"}, podVerbs...)},
		{APIGroups: []string{""}, Resources: []string{"pods/status"}, Verbs: []string{"patch"}},
		{APIGroups: []string{""}, Resources: []string{"namespaces"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
	}
}

func checkClusterRules(t *testing.T, r *rendered, podVerbs ...string) {
	t.Helper()
	if r.cr == nil {
		t.Fatal("no ClusterRole")
	}
	if want := clusterRules(podVerbs...); !reflect.DeepEqual(r.cr.Rules, want) {
		t.Errorf("ClusterRole rules:\n got %+v\nwant %+v", r.cr.Rules, want)
	}
}

// checkInvariants holds for every successful render.
func checkInvariants(t *testing.T, r *rendered) {
	t.Helper()
	if r.ds == nil {
		t.Fatal("no DaemonSet rendered")
	}
	ds := r.ds
	pod := ds.Spec.Template.Spec
	c := r.agent(t)
	privileged := valueBool(t, r, "securityContext.privileged")

	// Namespaced objects land in the release namespace, cluster ones nowhere.
	for _, o := range []interface{ GetNamespace() string }{ds, r.sa, r.role, r.rb, r.pdb, r.quota} {
		if !reflect.ValueOf(o).IsNil() && o.GetNamespace() != releaseNS {
			t.Errorf("%T in namespace %q, want %q", o, o.GetNamespace(), releaseNS)
		}
	}
	for _, o := range []interface{ GetNamespace() string }{r.cr, r.crb} {
		if !reflect.ValueOf(o).IsNil() && o.GetNamespace() != "" {
			t.Errorf("cluster-scoped %T has namespace %q", o, o.GetNamespace())
		}
	}

	// The selector must select the template (the API server rejects it otherwise).
	for k, v := range ds.Spec.Selector.MatchLabels {
		if pod := ds.Spec.Template.Labels[k]; pod != v {
			t.Errorf("selector %s=%s does not match template label %q", k, v, pod)
		}
	}
	if !pod.HostNetwork {
		t.Error("hostNetwork is false")
	}
	if perPod := valueString(r, "agent.socketHooks") == "pods"; pod.HostPID != perPod {
		t.Errorf("hostPID is %v with socketHooks %q: /host/proc is enough, but for ztunnel's PID with per-pod hooks", pod.HostPID, valueString(r, "agent.socketHooks"))
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil {
		t.Fatalf("update strategy %+v, want RollingUpdate", us)
	}
	if ms := us.RollingUpdate.MaxSurge; ms == nil || ms.IntValue() != 0 {
		t.Errorf("maxSurge %v, want 0 (host network ports)", ms)
	}

	// Security: privileged only when asked, and nothing the API server
	// refuses for an unprivileged container.
	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil {
		t.Fatal("container securityContext.privileged not set explicitly")
	}
	if *sc.Privileged != privileged {
		t.Errorf("privileged = %v, values ask %v", *sc.Privileged, privileged)
	}
	if !privileged {
		if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("capabilities %+v, want drop [ALL]", sc.Capabilities)
		}
		for _, m := range c.VolumeMounts {
			if m.MountPropagation != nil && *m.MountPropagation == corev1.MountPropagationBidirectional {
				t.Errorf("mount %s is Bidirectional, which needs privileged", m.MountPath)
			}
		}
	}
	if sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation {
		t.Error("allowPrivilegeEscalation: false is refused with SYS_ADMIN or privileged")
	}
	if sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Error("runAsUser is not 0: capabilities would be lost on exec")
	}
	if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		t.Error("root filesystem is writable")
	}

	// Probes on the health port, metrics port announced to Prometheus.
	healthPort, metricsPort := int32(0), int32(0)
	for _, p := range c.Ports {
		switch p.Name {
		case "health":
			healthPort = p.ContainerPort
		case "metrics":
			metricsPort = p.ContainerPort
		}
	}
	if healthPort != 8000 || metricsPort != 15014 {
		t.Errorf("ports health=%d metrics=%d, want 8000 and 15014", healthPort, metricsPort)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"readiness", c.ReadinessProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/healthz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s probe missing or not HTTP", p.name)
			continue
		}
		if g := p.probe.HTTPGet; g.Path != p.path || g.Port.IntValue() != int(healthPort) {
			t.Errorf("%s probe GET %s on %s, want %s on %d", p.name, g.Path, g.Port.String(), p.path, healthPort)
		}
	}
	// Metrics on agent.metricsAddress; announced to Prometheus unless that
	// is loopback, which no scraper off the node reaches.
	metricsHost := strings.Trim(valueString(r, "agent.metricsAddress"), "[]")
	ann := ds.Spec.Template.Annotations
	if loopback := metricsHost == "localhost" || metricsHost == "127.0.0.1" || metricsHost == "::1"; loopback {
		if _, ok := ann["prometheus.io/scrape"]; ok {
			t.Errorf("prometheus annotations %v for metrics on loopback", ann)
		}
	} else if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/port"] != fmt.Sprint(metricsPort) || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("prometheus annotations %v, want scrape on :%d/metrics", ann, metricsPort)
	}
	if got := flag1(t, c, "health-addr"); got != fmt.Sprintf(":%d", healthPort) {
		t.Errorf("--health-addr=%s, want :%d", got, healthPort)
	}
	if got, want := flag1(t, c, "metrics-addr"), net.JoinHostPort(metricsHost, fmt.Sprint(metricsPort)); got != want {
		t.Errorf("--metrics-addr=%s, want %s", got, want)
	}

	// Downward API.
	env := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			env[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	if env["NODE_NAME"] != "spec.nodeName" || env["POD_NAMESPACE"] != "metadata.namespace" {
		t.Errorf("downward API env %v, want NODE_NAME from spec.nodeName and POD_NAMESPACE from metadata.namespace", env)
	}
	// The Go runtime's limits follow the container's.
	limits := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.ResourceFieldRef != nil {
			limits[e.Name] = e.ValueFrom.ResourceFieldRef.Resource
		}
	}
	if want := map[string]string{"GOMEMLIMIT": "limits.memory", "GOMAXPROCS": "limits.cpu"}; !reflect.DeepEqual(limits, want) {
		t.Errorf("resource env %v, want %v", limits, want)
	}

	// Every object carries the revision label, as Istio's charts set it.
	rev := valueString(r, "revision")
	if rev == "" {
		rev = "default"
	}
	for _, o := range []interface{ GetLabels() map[string]string }{ds, r.sa, r.role, r.rb, r.pdb, r.cr, r.crb, r.quota} {
		if !reflect.ValueOf(o).IsNil() && o.GetLabels()["istio.io/rev"] != rev {
			t.Errorf("%T labels %v, want istio.io/rev=%s", o, o.GetLabels(), rev)
		}
	}

	// Every flag is one the agent has and takes with its value, and every
	// path it names is mounted.
	agentConfig(t, r)
	fl := flags(t, c)
	for name, vals := range fl {
		if len(vals) > 1 && !repeatableFlags[name] {
			t.Errorf("--%s given %d times", name, len(vals))
		}
	}
	ms := mounts(t, r)
	for _, name := range []string{"bpffs-dir", "cgroup-root", "proc-root", "zds-socket", "cni-socket", "inspect-socket", "cni-bin-dir", "cni-conf-dir"} {
		if len(fl[name]) == 0 {
			t.Errorf("--%s not set", name)
		}
		for _, p := range fl[name] {
			if _, ok := mountedAt(ms, p); !ok {
				t.Errorf("--%s=%s is on no host mount", name, p)
			}
		}
	}
	for _, name := range []string{"zds-socket", "cni-socket", "inspect-socket"} {
		// Socket paths reach the host (CNI plugin, ztunnel, CLI) unchanged.
		p := fl[name][0]
		if m, _ := mountedAt(ms, p); m.vol.HostPath == nil || m.vol.HostPath.Path != m.MountPath {
			t.Errorf("--%s=%s: its directory is not mounted at its host path", name, p)
		}
	}
	if got := flag1(t, c, "daemonset-name"); got != ds.Name {
		t.Errorf("--daemonset-name=%s, DaemonSet is %s", got, ds.Name)
	}
	if got := flag1(t, c, "daemonset-namespace"); got != "$(POD_NAMESPACE)" {
		t.Errorf("--daemonset-namespace=%s, want $(POD_NAMESPACE)", got)
	}
	if got := flag1(t, c, "node-name"); got != "$(NODE_NAME)" {
		t.Errorf("--node-name=%s, want $(NODE_NAME)", got)
	}

	// RBAC binds the DaemonSet's service account; the Role is the upgrade
	// check on this DaemonSet only.
	if !valueBool(t, r, "rbac.create") {
		return
	}
	saName := pod.ServiceAccountName
	for _, subj := range [][]rbacv1.Subject{r.crb.Subjects, r.rb.Subjects} {
		want := []rbacv1.Subject{{Kind: "ServiceAccount", Name: saName, Namespace: releaseNS}}
		if !reflect.DeepEqual(subj, want) {
			t.Errorf("binding subjects %+v, want %+v", subj, want)
		}
	}
	if r.crb.RoleRef.Name != r.cr.Name || r.crb.RoleRef.Kind != "ClusterRole" || r.rb.RoleRef.Name != r.role.Name || r.rb.RoleRef.Kind != "Role" {
		t.Errorf("role refs %+v and %+v do not name the rendered roles", r.crb.RoleRef, r.rb.RoleRef)
	}
	wantRole := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{ds.Name}, Verbs: []string{"get"}}}
	if !reflect.DeepEqual(r.role.Rules, wantRole) {
		t.Errorf("Role rules %+v, want %+v", r.role.Rules, wantRole)
	}
}

func TestChartRenders(t *testing.T) {
	cases := []struct {
		name       string
		values     string
		sets       []string // --set flags, after values
		skipSchema bool
		wantErr    string
		check      func(t *testing.T, r *rendered)
	}{
		{
			name:  "defaults",
			check: checkDefaults,
		},
		{
			name:   "repair off adds no pod writes",
			values: "agent: {repairMode: \"off\"}",
			check:  checkRepair("off"),
		},
		{
			name:   "repair delete adds pods delete",
			values: "agent: {repairMode: delete}",
			check:  checkRepair("delete", "delete"),
		},
		{
			name:   "repair label adds no pod writes (pods/status patch labels)",
			values: "agent: {repairMode: label}",
			check:  checkRepair("label"),
		},
		{
			name:   "sockmap acceleration on request",
			values: "agent: {sockmapAccel: ztunnel}",
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["sockmap-accel"], []string{"ztunnel"}) {
					t.Errorf("--sockmap-accel=%v, want ztunnel", fl["sockmap-accel"])
				}
			},
		},
		{
			name:   "cni chained in place on request",
			values: `cni: {ownedConflist: ""}`,
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["cni-owned-conflist"], []string{""}) {
					t.Errorf("--cni-owned-conflist=%v, want empty (in place)", fl["cni-owned-conflist"])
				}
			},
		},
		{
			name: "host probes direct by default, snat on request",
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["host-probes"], []string{"direct"}) || !slices.Equal(fl["pods-cgroup"], []string{"auto"}) ||
					!slices.Equal(fl["socket-hooks"], []string{"shared"}) {
					t.Errorf("--host-probes=%v --pods-cgroup=%v --socket-hooks=%v, want direct, auto and shared", fl["host-probes"], fl["pods-cgroup"], fl["socket-hooks"])
				}
			},
		},
		{
			name:   "pods cgroup auto by default, a directory on request",
			values: "agent: {podsCgroup: kubepods.slice}",
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["pods-cgroup"], []string{"kubepods.slice"}) {
					t.Errorf("--pods-cgroup=%v, want kubepods.slice", fl["pods-cgroup"])
				}
			},
		},
		{
			name:   "per-pod socket hooks",
			values: "agent: {socketHooks: pods, podsCgroup: kubepods.slice}",
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["socket-hooks"], []string{"pods"}) {
					t.Errorf("--socket-hooks=%v, want pods", fl["socket-hooks"])
				}
			},
		},
		{
			name:    "unknown socket hooks fail the schema",
			values:  "agent: {socketHooks: root}",
			wantErr: "/agent/socketHooks",
		},
		{
			name:   "host probes snat",
			values: "agent: {hostProbes: snat}",
			check: func(t *testing.T, r *rendered) {
				if fl := flags(t, r.agent(t)); !slices.Equal(fl["host-probes"], []string{"snat"}) {
					t.Errorf("--host-probes=%v, want snat", fl["host-probes"])
				}
			},
		},
		{
			name:    "unknown host-probe mode fails the schema",
			values:  "agent: {hostProbes: nat}",
			wantErr: "/agent/hostProbes",
		},
		{
			name:    "unknown sockmap acceleration mode fails the schema",
			values:  "agent: {sockmapAccel: true}",
			wantErr: "/agent/sockmapAccel",
		},
		{
			name:    "unknown repair mode fails the schema",
			values:  "agent: {repairMode: fix}",
			wantErr: "/agent/repairMode': value must be one of",
		},
		{
			name:       "unknown repair mode fails without the schema",
			values:     "agent: {repairMode: fix}",
			skipSchema: true,
			wantErr:    "agent.repairMode must be",
		},
		{
			name: "Istio's global values: registry, pull policy and secrets, JSON logs; not Istio's tag",
			values: `
global:
  hub: registry.corp.example/mirror/
  tag: 1.27.1
  imagePullPolicy: Always
  imagePullSecrets: [registry-a]
  logAsJson: true
  istioNamespace: istio-system
  meshID: mesh1
  proxy: {clusterDomain: cluster.local}
imagePullSecrets: [{name: registry-b}, registry-a]
`,
			check: func(t *testing.T, r *rendered) {
				c := r.agent(t)
				if c.Image != "registry.corp.example/mirror/ambient-ebpf:0.1.0" || c.ImagePullPolicy != corev1.PullAlways {
					t.Errorf("image %s pull %s, want the global hub, the chart's tag, Always", c.Image, c.ImagePullPolicy)
				}
				want := []corev1.LocalObjectReference{{Name: "registry-b"}, {Name: "registry-a"}}
				if got := r.ds.Spec.Template.Spec.ImagePullSecrets; !reflect.DeepEqual(got, want) {
					t.Errorf("imagePullSecrets %v, want %v", got, want)
				}
				if got := flag1(t, c, "log-format"); got != "json" {
					t.Errorf("--log-format=%s with global.logAsJson", got)
				}
			},
		},
		{
			name:   "image: own hub over the global one, own tag; repository replaces both",
			values: "global: {hub: docker.io/istio}\nimage: {hub: quay.io/mesh, tag: 0.2.0-rc.1, pullPolicy: Never}",
			check: func(t *testing.T, r *rendered) {
				if c := r.agent(t); c.Image != "quay.io/mesh/ambient-ebpf:0.2.0-rc.1" || c.ImagePullPolicy != corev1.PullNever {
					t.Errorf("image %s pull %s", c.Image, c.ImagePullPolicy)
				}
			},
		},
		{
			name:   "image repository",
			values: "global: {hub: docker.io/istio}\nimage: {hub: quay.io/mesh, repository: registry.example/team/redirector}",
			check: func(t *testing.T, r *rendered) {
				if c := r.agent(t); c.Image != "registry.example/team/redirector:0.1.0" || c.ImagePullPolicy != corev1.PullIfNotPresent {
					t.Errorf("image %s pull %s", c.Image, c.ImagePullPolicy)
				}
			},
		},
		{
			name:   "image flavor takeover, with the hand-back backend",
			values: "image: {flavor: takeover}\nagent: {istioCNI: {handBack: iptables-nft}}",
			check: func(t *testing.T, r *rendered) {
				c := r.agent(t)
				if c.Image != "ghcr.io/ambient-ebpf/ambient-ebpf:0.1.0-takeover" {
					t.Errorf("image %s, want the takeover flavor", c.Image)
				}
				if got := flag1(t, c, "istio-cni-handback"); got != "iptables-nft" {
					t.Errorf("--istio-cni-handback=%s", got)
				}
				if got := flag1(t, c, "istio-cni-takeover"); got != "true" {
					t.Errorf("--istio-cni-takeover=%s", got)
				}
			},
		},
		{
			name:   "log format set over global.logAsJson",
			values: "global: {logAsJson: true}\nagent: {logFormat: text}",
			check: func(t *testing.T, r *rendered) {
				if got := flag1(t, r.agent(t), "log-format"); got != "text" {
					t.Errorf("--log-format=%s, want text", got)
				}
			},
		},
		{
			name:    "an unknown log format fails the schema",
			values:  "agent: {logFormat: logfmt}",
			wantErr: "/agent/logFormat",
		},
		{
			name:   "ambient.ipv6 false is accepted and the notes say it changes nothing",
			values: "ambient: {ipv6: false}",
			check: func(t *testing.T, r *rendered) {
				if !strings.Contains(r.notes, "ambient.ipv6=false changes nothing") {
					t.Errorf("NOTES.txt:\n%s", r.notes)
				}
			},
		},
		{
			name:   "own enablement selectors reach the agent",
			values: "ambient: {enablementSelectors: [{podSelector: {matchLabels: {mesh: \"yes\"}}, namespaceSelector: {matchExpressions: [{key: team, operator: Exists}]}}]}",
			check: func(t *testing.T, r *rendered) {
				sel := agentConfig(t, r).Enrollment.Selectors
				if len(sel) != 1 || sel[0].PodSelector.MatchLabels["mesh"] != "yes" || sel[0].NamespaceSelector.MatchExpressions[0].Key != "team" {
					t.Errorf("agent selectors %+v", sel)
				}
			},
		},
		{
			name:    "an enablement selector the API would refuse fails the schema",
			values:  "ambient: {enablementSelectors: [{podSelector: {matchExpressions: [{key: a, operator: Near}]}}]}",
			wantErr: "/ambient/enablementSelectors/0/podSelector/matchExpressions/0/operator",
		},
		{
			name:   "revision labels every object, names stay",
			values: "revision: 1-27-1",
			check: func(t *testing.T, r *rendered) {
				if r.ds.Name != "ambient-ebpf" || r.cr.Name != "ambient-ebpf" {
					t.Errorf("names %s, %s changed with the revision", r.ds.Name, r.cr.Name)
				}
			},
		},
		{
			name:    "a revision that is no label value fails the schema",
			values:  "revision: Canary_1",
			wantErr: "/revision",
		},
		{
			name:   "daemonSetLabels on the DaemonSet only",
			values: "daemonSetLabels: {team: mesh}",
			check: func(t *testing.T, r *rendered) {
				if r.ds.Labels["team"] != "mesh" || r.ds.Spec.Template.Labels["team"] != "" {
					t.Errorf("DaemonSet labels %v, pod labels %v", r.ds.Labels, r.ds.Spec.Template.Labels)
				}
			},
		},
		{
			name:   "resource quota for system-node-critical",
			values: "resourceQuotas: {enabled: true, pods: 200}",
			check:  checkQuota(200),
		},
		{
			name:   "platform gke: its bin directory and the resource quota",
			values: "platform: gke",
			check: func(t *testing.T, r *rendered) {
				checkCNIPaths([]string{"/home/kubernetes/bin"}, "/etc/cni/net.d")(t, r)
				checkQuota(5000)(t, r)
			},
		},
		{
			name:   "platform gke without the quota",
			values: "platform: gke\nresourceQuotas: {enabled: false}",
			check: func(t *testing.T, r *rendered) {
				if r.quota != nil {
					t.Error("ResourceQuota rendered though resourceQuotas.enabled is false")
				}
			},
		},
		{
			name:   "platform k3s from global.platform",
			values: "global: {platform: k3s}",
			check:  checkCNIPaths([]string{"/var/lib/rancher/k3s/data/cni"}, "/var/lib/rancher/k3s/agent/etc/cni/net.d"),
		},
		{
			name:   "platform microk8s, explicit bin directories win",
			values: "platform: microk8s\ncni: {binDirs: [/opt/cni/bin]}",
			check:  checkCNIPaths([]string{"/opt/cni/bin"}, "/var/snap/microk8s/current/args/cni-network"),
		},
		{
			name:    "an unknown platform fails the schema",
			values:  "platform: aks",
			wantErr: "/platform",
		},
		{
			name:       "an unknown global.platform fails the render",
			values:     "global: {platform: openshift}",
			skipSchema: true,
			wantErr:    `platform "openshift": want`,
		},
		{
			name:   "PodMonitor",
			values: "podMonitor: {enabled: true, interval: 30s, labels: {release: prometheus}}",
			check: func(t *testing.T, r *rendered) {
				pm := r.pm
				if pm == nil {
					t.Fatal("no PodMonitor")
				}
				if pm.Metadata.Namespace != releaseNS || pm.Metadata.Labels["release"] != "prometheus" {
					t.Errorf("PodMonitor metadata %+v", pm.Metadata)
				}
				if !reflect.DeepEqual(pm.Spec.Selector.MatchLabels, r.ds.Spec.Selector.MatchLabels) ||
					!slices.Equal(pm.Spec.NamespaceSelector.MatchNames, []string{releaseNS}) {
					t.Errorf("PodMonitor selects %+v in %v, DaemonSet pods are %v", pm.Spec.Selector, pm.Spec.NamespaceSelector, r.ds.Spec.Selector)
				}
				e := pm.Spec.PodMetricsEndpoints
				if len(e) != 1 || e[0].Port != "metrics" || e[0].Path != "/metrics" || e[0].Interval != "30s" {
					t.Errorf("PodMonitor endpoints %+v", e)
				}
			},
		},
		{
			name:    "a PodMonitor cannot scrape loopback metrics",
			values:  "podMonitor: {enabled: true}\nagent: {metricsAddress: 127.0.0.1}",
			wantErr: "loopback",
		},
		{
			name: "helm template with Istio's usual flags",
			sets: []string{"profile=ambient", "global.hub=docker.io/istio", "global.tag=1.27.1", "global.variant=distroless", "global.platform=k3s", "global.logAsJson=true",
				"global.imagePullSecrets[0]=registry-key", "revision=1-27-1", "resourceQuotas.enabled=true", "global.istioNamespace=istio-system"},
			check: func(t *testing.T, r *rendered) {
				c := r.agent(t)
				if c.Image != "docker.io/istio/ambient-ebpf:0.1.0" || flag1(t, c, "log-format") != "json" {
					t.Errorf("image %s, --log-format=%s", c.Image, flag1(t, c, "log-format"))
				}
				checkCNIPaths([]string{"/var/lib/rancher/k3s/data/cni"}, "/var/lib/rancher/k3s/agent/etc/cni/net.d")(t, r)
				checkQuota(5000)(t, r)
			},
		},
		{
			name:    "a global of the wrong type fails the schema",
			values:  "global: {logAsJson: \"yes\"}",
			wantErr: "/global/logAsJson",
		},
		{
			name:    "a log level the agent refuses fails the schema",
			values:  "agent: {logLevel: \"default:info\"}",
			wantErr: "/agent/logLevel",
		},
		{
			name:    "misspelt value fails the schema",
			values:  "nodeselector: {pool: mesh}",
			wantErr: "additional properties 'nodeselector' not allowed",
		},
		{
			name:    "relative host path fails the schema",
			values:  "cni: {confDir: etc/cni/net.d}",
			wantErr: "/cni/confDir",
		},
		{
			name:   "pod disruption budget",
			values: "podDisruptionBudget: {enabled: true}",
			check: func(t *testing.T, r *rendered) {
				if r.pdb == nil {
					t.Fatal("no PodDisruptionBudget")
				}
				if mu := r.pdb.Spec.MaxUnavailable; mu == nil || mu.IntValue() != 1 || r.pdb.Spec.MinAvailable != nil {
					t.Errorf("PDB spec %+v, want maxUnavailable 1", r.pdb.Spec)
				}
				if !reflect.DeepEqual(r.pdb.Spec.Selector, r.ds.Spec.Selector) {
					t.Errorf("PDB selector %v, DaemonSet selector %v", r.pdb.Spec.Selector, r.ds.Spec.Selector)
				}
			},
		},
		{
			name:   "pod disruption budget by minAvailable",
			values: "podDisruptionBudget: {enabled: true, minAvailable: 90%}",
			check: func(t *testing.T, r *rendered) {
				if r.pdb == nil {
					t.Fatal("no PodDisruptionBudget")
				}
				if ma := r.pdb.Spec.MinAvailable; ma == nil || ma.String() != "90%" || r.pdb.Spec.MaxUnavailable != nil {
					t.Errorf("PDB spec %+v, want minAvailable 90%% only", r.pdb.Spec)
				}
			},
		},
		{
			name:   "node selector merges over the default",
			values: "nodeSelector: {ambient-ebpf.io/capable: \"true\"}",
			check:  checkNodeSelector(map[string]string{"kubernetes.io/os": "linux", "ambient-ebpf.io/capable": "true"}),
		},
		{
			name:   "default node selector can be dropped",
			values: "defaultNodeSelector: null\nnodeSelector: {pool: mesh}",
			check:  checkNodeSelector(map[string]string{"pool": "mesh"}),
		},
		{
			name:   "privileged on request",
			values: "securityContext: {privileged: true}",
			check: func(t *testing.T, r *rendered) {
				sc := r.agent(t).SecurityContext
				if sc.Capabilities != nil || sc.AppArmorProfile != nil {
					t.Errorf("privileged container still lists capabilities %+v or AppArmor %+v", sc.Capabilities, sc.AppArmorProfile)
				}
				m, _ := mountedAt(mounts(t, r), "/sys/fs/bpf")
				if m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional {
					t.Errorf("bpffs propagation %v, want Bidirectional when privileged", m.MountPropagation)
				}
			},
		},
		{
			name: "names, paths and resources",
			values: `
fullnameOverride: mesh-redirect
resources: {requests: {cpu: 50m}, limits: {memory: 512Mi}}
cni: {binDirs: [/opt/cni/bin, /var/lib/cni/bin], confDir: /etc/kubernetes/cni/net.d, confName: 05-ambient-ebpf.conflist}
agent: {probeSNAT: {ipv4: 169.254.7.128}, excludedNamespaces: [kube-system, kube-public], dnsCapture: false}
hostPaths: {ztunnelSocketDir: /run/ztunnel}
`,
			check: func(t *testing.T, r *rendered) {
				c := r.agent(t)
				if r.ds.Name != "mesh-redirect" || r.cr.Name != "mesh-redirect" {
					t.Errorf("names %s, %s, want mesh-redirect", r.ds.Name, r.cr.Name)
				}
				fl := flags(t, c)
				want := map[string][]string{
					"cni-bin-dir":         {"/host/opt/cni/bin", "/host/var/lib/cni/bin"},
					"cni-conf-dir":        {"/host/etc/kubernetes/cni/net.d"},
					"cni-conf-name":       {"05-ambient-ebpf.conflist"},
					"probe-snat-v4":       {"169.254.7.128"},
					"excluded-namespaces": {"kube-system,kube-public"},
					"dns-capture":         {"false"},
					"zds-socket":          {"/run/ztunnel/ztunnel.sock"},
				}
				for k, v := range want {
					if !slices.Equal(fl[k], v) {
						t.Errorf("--%s=%v, want %v", k, fl[k], v)
					}
				}
				if _, ok := fl["probe-snat-v6"]; ok {
					t.Error("--probe-snat-v6 set though the value is empty")
				}
				res := c.Resources
				if res.Requests.Cpu().String() != "50m" || res.Limits.Memory().String() != "512Mi" || !res.Requests.Memory().IsZero() {
					t.Errorf("resources %+v do not replace the defaults", res)
				}
			},
		},
		{
			name:   "metrics on loopback only",
			values: "agent: {metricsAddress: 127.0.0.1}",
			check:  func(*testing.T, *rendered) {}, // the invariants check flag and annotations
		},
		{
			name:   "metrics on IPv6 loopback",
			values: `agent: {metricsAddress: "::1"}`,
			check:  func(*testing.T, *rendered) {},
		},
		{
			name:   "metrics on the node's address",
			values: `agent: {metricsAddress: "$(HOST_IP)"}`,
			check: func(t *testing.T, r *rendered) {
				for _, e := range r.agent(t).Env {
					if e.Name == "HOST_IP" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "status.hostIP" {
						return
					}
				}
				t.Error("no HOST_IP from status.hostIP for --metrics-addr=$(HOST_IP):15014")
			},
		},
		{
			name:   "per-pod metrics on request",
			values: "agent: {perPodMetrics: true}",
			check: func(t *testing.T, r *rendered) {
				if !agentConfig(t, r).PerPodMetrics {
					t.Error("agent.perPodMetrics does not reach the agent")
				}
			},
		},
		{
			name:   "trace history on request",
			values: "agent: {traceHistory: 10m}",
			check: func(t *testing.T, r *rendered) {
				if got := agentConfig(t, r).TraceHistory; got != 10*time.Minute {
					t.Errorf("agent.traceHistory 10m reaches the agent as %v", got)
				}
			},
		},
		{
			name:    "trace history that is not a duration fails the schema",
			values:  "agent: {traceHistory: ten minutes}",
			wantErr: "traceHistory",
		},
		{
			name:    "metrics address with a port fails the schema",
			values:  "agent: {metricsAddress: \"127.0.0.1:15014\"}",
			wantErr: "/agent/metricsAddress",
		},
		{
			name:   "existing service account",
			values: "serviceAccount: {create: false, name: mesh-agent}",
			check: func(t *testing.T, r *rendered) {
				if r.sa != nil {
					t.Error("ServiceAccount rendered though create is false")
				}
				if got := r.ds.Spec.Template.Spec.ServiceAccountName; got != "mesh-agent" {
					t.Errorf("serviceAccountName %s", got)
				}
			},
		},
		{
			name:    "existing service account needs a name",
			values:  "serviceAccount: {create: false}",
			wantErr: "serviceAccount.name is required",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r, err := renderChartSchema(tc.values, !tc.skipSchema, tc.sets...)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("render error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			checkInvariants(t, r)
			tc.check(t, r)
			if t.Failed() {
				t.Logf("rendered manifest:\n%s", r.manifest)
			}
			t.Run("server-side dry run", func(t *testing.T) { dryRun(t, r) })
		})
	}
}

// checkRepair checks the repair mode flag and the pod verbs it adds.
func checkRepair(mode string, podVerbs ...string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		checkClusterRules(t, r, podVerbs...)
		if got := flag1(t, r.agent(t), "repair-mode"); got != mode {
			t.Errorf("--repair-mode=%s, want %s", got, mode)
		}
	}
}

// checkQuota checks the ResourceQuota admitting the agent's priority class.
func checkQuota(pods int64) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		q := r.quota
		if q == nil {
			t.Fatal("no ResourceQuota")
		}
		if got := q.Spec.Hard.Pods().Value(); got != pods {
			t.Errorf("quota pods %d, want %d", got, pods)
		}
		want := &corev1.ScopeSelector{MatchExpressions: []corev1.ScopedResourceSelectorRequirement{{
			ScopeName: corev1.ResourceQuotaScopePriorityClass, Operator: corev1.ScopeSelectorOpIn,
			Values: []string{r.ds.Spec.Template.Spec.PriorityClassName}}}}
		if !reflect.DeepEqual(q.Spec.ScopeSelector, want) {
			t.Errorf("quota scope %+v, want %+v", q.Spec.ScopeSelector, want)
		}
	}
}

// checkCNIPaths checks the host CNI directories the agent is given and has mounted.
func checkCNIPaths(binDirs []string, confDir string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		fl := flags(t, r.agent(t))
		var wantBins []string
		for _, d := range binDirs {
			wantBins = append(wantBins, "/host"+d)
		}
		if !slices.Equal(fl["cni-bin-dir"], wantBins) || !slices.Equal(fl["cni-conf-dir"], []string{"/host" + confDir}) {
			t.Errorf("--cni-bin-dir=%v --cni-conf-dir=%v, want %v and /host%s", fl["cni-bin-dir"], fl["cni-conf-dir"], wantBins, confDir)
		}
		ms := mounts(t, r)
		for i, d := range binDirs {
			if m, ok := ms[wantBins[i]]; !ok || m.vol.HostPath == nil || m.vol.HostPath.Path != d {
				t.Errorf("%s is not the host's %s", wantBins[i], d)
			}
		}
	}
}

func checkNodeSelector(want map[string]string) func(*testing.T, *rendered) {
	return func(t *testing.T, r *rendered) {
		if got := r.ds.Spec.Template.Spec.NodeSelector; !reflect.DeepEqual(got, want) {
			t.Errorf("nodeSelector %v, want %v", got, want)
		}
	}
}

func checkDefaults(t *testing.T, r *rendered) {
	wantKinds := []string{
		"apps/v1 DaemonSet",
		"rbac.authorization.k8s.io/v1 ClusterRole",
		"rbac.authorization.k8s.io/v1 ClusterRoleBinding",
		"rbac.authorization.k8s.io/v1 Role",
		"rbac.authorization.k8s.io/v1 RoleBinding",
		"v1 ServiceAccount",
	}
	got := slices.Clone(r.kinds)
	sort.Strings(got)
	if !slices.Equal(got, wantKinds) {
		t.Errorf("objects %v, want %v", got, wantKinds)
	}
	checkClusterRules(t, r)

	ds := r.ds
	pod := ds.Spec.Template.Spec
	c := r.agent(t)
	if ds.Name != "ambient-ebpf" || pod.ServiceAccountName != "ambient-ebpf" || r.sa.Name != "ambient-ebpf" {
		t.Errorf("names: DaemonSet %s, service account %s/%s", ds.Name, pod.ServiceAccountName, r.sa.Name)
	}
	if pod.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", pod.PriorityClassName)
	}
	if mu := ds.Spec.UpdateStrategy.RollingUpdate.MaxUnavailable; mu == nil || mu.IntValue() != 1 {
		t.Errorf("maxUnavailable %v, want 1", mu)
	}
	if want := map[string]string{"kubernetes.io/os": "linux"}; !reflect.DeepEqual(pod.NodeSelector, want) {
		t.Errorf("nodeSelector %v, want %v", pod.NodeSelector, want)
	}
	if len(pod.Tolerations) != 3 {
		t.Errorf("tolerations %v, want istio-cni's three", pod.Tolerations)
	}
	if c.Image != "ghcr.io/ambient-ebpf/ambient-ebpf:0.1.0" || !slices.Equal(c.Command, []string{"/usr/local/bin/ambient-ebpf-agent"}) {
		t.Errorf("image %s command %v", c.Image, c.Command)
	}
	if res := c.Resources; res.Requests.Cpu().String() != "100m" || res.Requests.Memory().String() != "100Mi" || len(res.Limits) != 0 {
		t.Errorf("resources %+v, want defaultResources", res)
	}

	sc := c.SecurityContext
	wantCaps := []corev1.Capability{"NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE"}
	if !slices.Equal(sc.Capabilities.Add, wantCaps) {
		t.Errorf("capabilities add %v, want %v", sc.Capabilities.Add, wantCaps)
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccomp %+v, want RuntimeDefault", sc.SeccompProfile)
	}
	if sc.AppArmorProfile == nil || sc.AppArmorProfile.Type != corev1.AppArmorProfileTypeUnconfined {
		t.Errorf("AppArmor %+v, want Unconfined", sc.AppArmorProfile)
	}
	if sc.SELinuxOptions != nil {
		t.Errorf("seLinuxOptions %+v set by default", sc.SELinuxOptions)
	}

	// Host mounts: container path -> host path, read-only, propagation.
	type want struct {
		host        string
		readOnly    bool
		propagation corev1.MountPropagationMode
	}
	wantMounts := map[string]want{
		"/sys/fs/bpf":           {"/sys/fs/bpf", false, corev1.MountPropagationHostToContainer},
		"/host/sys/fs/cgroup":   {"/sys/fs/cgroup", true, ""},
		"/host/proc":            {"/proc", false, ""},
		"/var/run/netns":        {"/var/run/netns", true, corev1.MountPropagationHostToContainer},
		"/var/run/ztunnel":      {"/var/run/ztunnel", false, ""},
		"/var/run/ambient-ebpf": {"/var/run/ambient-ebpf", false, ""},
		"/host/opt/cni/bin":     {"/opt/cni/bin", false, ""},
		"/host/etc/cni/net.d":   {"/etc/cni/net.d", false, ""},
		"/tmp":                  {"", false, ""},
	}
	ms := mounts(t, r)
	if len(ms) != len(wantMounts) {
		t.Errorf("%d mounts, want %d", len(ms), len(wantMounts))
	}
	for mp, w := range wantMounts {
		m, ok := ms[mp]
		if !ok {
			t.Errorf("nothing mounted at %s", mp)
			continue
		}
		host := ""
		if m.vol.HostPath != nil {
			host = m.vol.HostPath.Path
		}
		prop := corev1.MountPropagationMode("")
		if m.MountPropagation != nil {
			prop = *m.MountPropagation
		}
		if host != w.host || m.ReadOnly != w.readOnly || prop != w.propagation {
			t.Errorf("mount %s: host %q readOnly %v propagation %q, want %q %v %q", mp, host, m.ReadOnly, prop, w.host, w.readOnly, w.propagation)
		}
	}

	fl := flags(t, c)
	wantFlags := map[string]string{
		"bpffs-dir":           "/sys/fs/bpf/ambient-ebpf",
		"cgroup-root":         "/host/sys/fs/cgroup",
		"proc-root":           "/host/proc",
		"zds-socket":          "/var/run/ztunnel/ztunnel.sock",
		"cni-socket":          "/var/run/ambient-ebpf/cni.sock",
		"inspect-socket":      "/var/run/ambient-ebpf/inspect.sock",
		"cni-bin-dir":         "/host/opt/cni/bin",
		"cni-conf-dir":        "/host/etc/cni/net.d",
		"cni-owned-conflist":  "00-ambient-ebpf.conflist",
		"excluded-namespaces": "kube-system",
		"system-namespace":    "istio-system",
		"dns-capture":         "true",
		"repair-mode":         "repair",
		"log-level":           "info",
	}
	for k, v := range wantFlags {
		if !slices.Equal(fl[k], []string{v}) {
			t.Errorf("--%s=%v, want %s", k, fl[k], v)
		}
	}
	for _, k := range []string{"cni-conf-name", "probe-snat-v4", "probe-snat-v6", "kubeconfig", "per-pod-metrics", "enablement-selectors", "trace-history", "sockmap-accel"} {
		if _, ok := fl[k]; ok {
			t.Errorf("--%s set by default", k)
		}
	}
}

// TestChartKubeVersion keeps Chart.yaml's kubeVersion in step with the API
// fields the templates use (securityContext.appArmorProfile is 1.30).
func TestChartKubeVersion(t *testing.T) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	for v, want := range map[string]bool{minKube: true, "v1.29.9": false, "v1.37.2": true} {
		if got := chartutil.IsCompatibleRange(ch.Metadata.KubeVersion, v); got != want {
			t.Errorf("kubeVersion %q accepts %s = %v, want %v", ch.Metadata.KubeVersion, v, got, want)
		}
	}
	if err := ch.Validate(); err != nil {
		t.Errorf("Chart.yaml: %v", err)
	}
}
