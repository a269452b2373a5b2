// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package agent

import (
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/dataplane/accel"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/enrollment"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/kube"
)

func parse(t *testing.T, args ...string) (Config, error) {
	t.Helper()
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	f := NewFlags(fs)
	if err := fs.Parse(append([]string{"--cgroup-root", "/sys/fs/cgroup"}, args...)); err != nil {
		t.Fatal(err)
	}
	return f.Config()
}

func TestFlagsBuildTheConfig(t *testing.T) {
	c, err := parse(t, "--node-name", "n1", "--excluded-namespaces", "kube-system, istio-system", "--repair-mode", "delete",
		"--cni-conf-dir", "/host/etc/cni/net.d")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(c.Enrollment.ExcludedNamespaces, []string{"kube-system", "istio-system"}) {
		t.Errorf("excluded namespaces %v", c.Enrollment.ExcludedNamespaces)
	}
	if c.Repair.Mode != kube.RepairDelete {
		t.Errorf("repair mode %q", c.Repair.Mode)
	}
	if c.Install == nil || c.Install.KubeconfigPath != "/host/etc/cni/net.d/ambient-ebpf-cni.kubeconfig" ||
		c.Install.KubeconfigHostPath != "/etc/cni/net.d/ambient-ebpf-cni.kubeconfig" {
		t.Errorf("plugin kubeconfig: %+v", c.Install)
	}
}

// The installer chains into an owned conflist unless told to chain in
// place; a name runtimes would not read, or a path, is refused.
func TestOwnedConflistFlag(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		want    string
		wantErr bool
	}{
		{nil, DefaultOwnedConflist, false},
		{[]string{"--cni-owned-conflist="}, "", false},
		{[]string{"--cni-owned-conflist=01-mesh.conflist"}, "01-mesh.conflist", false},
		{[]string{"--cni-owned-conflist=01-mesh.conf"}, "", true},
		{[]string{"--cni-owned-conflist=../01-mesh.conflist"}, "", true},
	} {
		c, err := parse(t, tc.args...)
		if tc.wantErr {
			if err == nil {
				t.Errorf("%v accepted", tc.args)
			}
			continue
		}
		if err != nil || c.Install == nil || c.Install.OwnedConflist != tc.want {
			t.Errorf("%v: owned conflist %+v (%v), want %q", tc.args, c.Install, err, tc.want)
		}
	}
}

// --sockmap-accel is off unless given, from the environment too (the
// benchmark starts agents that way).
func TestSockmapAccelFlag(t *testing.T) {
	for _, c := range []struct {
		env  string
		args []string
		want accel.Mode
	}{
		{"", nil, accel.Off},
		{"", []string{"--sockmap-accel", "both"}, accel.Both},
		{"ztunnel", nil, accel.ToZtunnel},
		{"ztunnel", []string{"--sockmap-accel=off"}, accel.Off},
	} {
		if c.env != "" {
			t.Setenv("AMBIENT_EBPF_SOCKMAP_ACCEL", c.env)
		}
		cfg, err := parse(t, append([]string{"--node-name", "n1"}, c.args...)...)
		if err != nil {
			t.Fatal(err)
		}
		if cfg.Dataplane.SockmapAccel != c.want {
			t.Errorf("env %q, args %v: mode %q, want %q", c.env, c.args, cfg.Dataplane.SockmapAccel, c.want)
		}
	}
}

func TestFlagsRefuseBadValues(t *testing.T) {
	for name, args := range map[string][]string{
		"repair mode":   {"--repair-mode", "sometimes"},
		"probe v4":      {"--probe-snat-v4", "not-an-ip"},
		"log level":     {"--log-level", "loud"},
		"log format":    {"--log-format", "xml"},
		"trace history": {"--trace-history", "-1m"},
		"sockmap":       {"--sockmap-accel", "on"},
		"selectors":     {"--enablement-selectors", `[{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}]`},
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := parse(t, append([]string{"--node-name", "n1"}, args...)...); err == nil {
				t.Errorf("%v accepted", args)
			}
		})
	}
}

// The enablement selectors reach the controllers and the plugin's conflist
// entry, for its fallback decision.
func TestEnablementSelectorsReachThePlugin(t *testing.T) {
	c, err := parse(t, "--node-name", "n1", "--enablement-selectors", `[{"podSelector": {"matchLabels": {"mesh": "yes"}}}]`)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Enrollment.Selectors) != 1 || c.Enrollment.Selectors[0].PodSelector.MatchLabels["mesh"] != "yes" {
		t.Errorf("selectors %+v", c.Enrollment.Selectors)
	}
	if c.Install == nil {
		t.Fatal("no install configuration")
	}
	got, err := enrollment.ParseSelectors(c.Install.Plugin.EnablementSelectors)
	if err != nil || !reflect.DeepEqual(got, c.Enrollment.Selectors) {
		t.Errorf("plugin settings carry %s (%v), want %+v", c.Install.Plugin.EnablementSelectors, err, c.Enrollment.Selectors)
	}
}

// --pods-cgroup: auto finds kubelet's cgroup below the root (either
// driver's name), none and an absent one attach at the root, and a
// relative directory is below the root.
func TestPodsCgroupFlag(t *testing.T) {
	for _, c := range []struct {
		dirs []string
		arg  string
		want string // below the root; "": none
	}{
		{nil, "", ""},
		{[]string{"kubepods"}, "", "kubepods"},
		{[]string{"kubepods.slice", "kubepods"}, "", "kubepods.slice"},
		{[]string{"kubepods"}, "none", ""},
		{nil, "pods", "pods"},
	} {
		root := t.TempDir()
		for _, d := range c.dirs {
			if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		fs := flag.NewFlagSet("agent", flag.ContinueOnError)
		f := NewFlags(fs)
		args := []string{"--cgroup-root", root, "--node-name", "n1"}
		if c.arg != "" {
			args = append(args, "--pods-cgroup", c.arg)
		}
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.Config()
		if err != nil {
			t.Fatal(err)
		}
		want := ""
		if c.want != "" {
			want = filepath.Join(root, c.want)
		}
		if cfg.Dataplane.PodsCgroup != want {
			t.Errorf("dirs %v, --pods-cgroup %q: %q, want %q", c.dirs, c.arg, cfg.Dataplane.PodsCgroup, want)
		}
	}
}

// --socket-hooks: shared by default, pods with a pods cgroup; pods
// without one and an unknown value are refused, naming the flags.
func TestSocketHooksFlag(t *testing.T) {
	for _, c := range []struct {
		args    []string
		want    dataplane.SocketHooks
		wantErr string
	}{
		{nil, dataplane.SocketHooksShared, ""},
		{[]string{"--socket-hooks=pods"}, dataplane.SocketHooksPods, ""},
		{[]string{"--socket-hooks=pods", "--pods-cgroup=none"}, "", "--socket-hooks=pods needs a pods cgroup: --pods-cgroup=none"},
		{[]string{"--socket-hooks=cgroup"}, "", "--socket-hooks=cgroup: want shared or pods"},
	} {
		root := t.TempDir()
		if err := os.Mkdir(filepath.Join(root, "kubepods"), 0o755); err != nil {
			t.Fatal(err)
		}
		fs := flag.NewFlagSet("agent", flag.ContinueOnError)
		f := NewFlags(fs)
		if err := fs.Parse(append([]string{"--cgroup-root", root, "--node-name", "n1"}, c.args...)); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.Config()
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%v: error %v, want %q", c.args, err, c.wantErr)
			}
			continue
		}
		if err != nil || cfg.Dataplane.SocketHooks != c.want {
			t.Errorf("%v: %q, %v; want %q", c.args, cfg.Dataplane.SocketHooks, err, c.want)
		}
	}
}
