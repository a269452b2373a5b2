// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package validate

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

// hostile are the names every entry point is tested with: traversal, NUL,
// overlong, unicode, separators.
var hostile = []string{
	"", ".", "..", "../../links", "shop/../../links", "a/b", "/abs", "a\x00b", "\x00",
	strings.Repeat("a", 256), "ünï", "web\u200b", "web\n", "web ", " web", "a:b", "a\\b",
	"\xff\xfe", "%2e%2e", "UPPER",
}

func TestCheckersAcceptRealIdentities(t *testing.T) {
	cases := []struct {
		name  string
		check func(string) error
		value string
	}{
		{"namespace", Namespace, "kube-system"},
		{"namespace 63 bytes", Namespace, strings.Repeat("n", 63)},
		{"pod name", PodName, "web-7d4b9c-x2x9z"},
		{"dotted pod name", PodName, "web.v2"},
		{"pod name 253 bytes", PodName, strings.Repeat("a", 253)},
		{"uuid", PodUID, "0d3e6a52-1f4b-4c1e-9a57-6f2b8c3d4e01"},
		{"test uid", PodUID, "uid_web.1"},
		{"uid 39 bytes", PodUID, strings.Repeat("u", 39)},
		{"standalone uid", PodUID, StandaloneUID("shop", "../../links")},
		{"containerd id", ContainerID, "4a1c7b0e9f3d2c1b0a9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a"},
		{"short container id", ContainerID, "sandbox-1"},
		{"infra id", InfraContainerID, "pause_1.x"},
		{"interface", Interface, "eth0"},
		{"interface 15 bytes", Interface, "abcdefghijklmno"},
		{"interface with dot", Interface, "eth0.100"},
		{"netns", NetnsPath, "/var/run/netns/cni-1234"},
		{"proc netns", NetnsPath, "/proc/42/ns/net"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.check(tc.value); err != nil {
				t.Errorf("refused %q: %v", tc.value, err)
			}
		})
	}
}

func TestCheckersRefuseHostileValuesNamingFieldAndValue(t *testing.T) {
	checks := map[string]func(string) error{
		"pod namespace": Namespace,
		"pod name":      PodName,
		"pod uid":       PodUID,
		"container id":  ContainerID,
	}
	for field, check := range checks {
		for _, v := range hostile {
			if field == "pod uid" && v == "UPPER" || field == "container id" && v == "UPPER" {
				continue // upper case is fine there
			}
			err := check(v)
			if err == nil {
				t.Errorf("%s %q accepted", field, v)
				continue
			}
			var ie *Error
			if !errors.Is(err, ErrInvalid) || !errors.As(err, &ie) || ie.Field != field {
				t.Errorf("%s %q: error %v does not wrap ErrInvalid for its field", field, v, err)
			}
			if msg := err.Error(); !strings.HasPrefix(msg, "invalid "+field+" ") || strings.ContainsRune(msg, 0) {
				t.Errorf("%s %q: message %q", field, v, msg)
			}
		}
	}
	for _, v := range []string{"", ".", "..", "a/b", "a:b", "eth 0", "eth\t0", "a\x00", "sixteen-bytes-xx", "\xff", "eth\u00a0"} {
		if err := Interface(v); err == nil || !strings.Contains(err.Error(), "interface name") {
			t.Errorf("interface %q: %v", v, err)
		}
	}
	for _, v := range []string{"", "relative/ns", "/var/run/netns/a\x00b", "/" + strings.Repeat("x", MaxNetnsPathLen)} {
		if err := NetnsPath(v); err == nil || !strings.Contains(err.Error(), "netns path") {
			t.Errorf("netns %q: %v", v, err)
		}
	}
	if err := PodUID(strings.Repeat("u", 40)); err == nil {
		t.Error("40-byte uid accepted")
	}
}

func TestErrorsQuoteAndShortenTheValue(t *testing.T) {
	err := PodName(strings.Repeat("x", 1000) + "/")
	if msg := err.Error(); len(msg) > 500 || !strings.Contains(msg, "(1001 bytes)") || !strings.HasPrefix(msg, `invalid pod name "xxx`) {
		t.Errorf("message %q", msg)
	}
	if msg := Namespace("a\x00b").Error(); !strings.Contains(msg, `"a\x00b"`) {
		t.Errorf("message %q does not quote the NUL", msg)
	}
}

func TestPodChecksEachField(t *testing.T) {
	if err := PodNames("shop", "web"); err != nil {
		t.Errorf("pod names: %v", err)
	}
	if err := Pod("shop", "web", ""); !errors.Is(err, ErrInvalid) {
		t.Errorf("pod without uid: %v", err)
	}
	for _, c := range [][3]string{{"shop/..", "web", "u"}, {"shop", "../links", "u"}, {"shop", "web", "../../links"}} {
		if err := Pod(c[0], c[1], c[2]); !errors.Is(err, ErrInvalid) {
			t.Errorf("Pod%q = %v", c, err)
		}
	}
}

func TestStandaloneUIDIsStableAndDistinct(t *testing.T) {
	a, b := StandaloneUID("shop", "web"), StandaloneUID("shop", "web")
	if a != b || len(a) != MaxUIDLen || !strings.HasPrefix(a, StandalonePrefix) {
		t.Errorf("StandaloneUID = %q, %q", a, b)
	}
	if StandaloneUID("shop", "web") == StandaloneUID("shopw", "eb") {
		t.Error("different pods share a standalone uid")
	}
}

// An accepted UID names exactly one directory right under the pins root,
// and so does every standalone UID.
func FuzzPodUID(f *testing.F) {
	for _, s := range hostile {
		f.Add(s, "shop", "web")
	}
	f.Add("0d3e6a52-1f4b-4c1e-9a57-6f2b8c3d4e01", "demo", "web")
	f.Add("...", "a.b", "c")
	f.Fuzz(func(t *testing.T, uid, namespace, name string) {
		const root = "/sys/fs/bpf/ambient-ebpf/pods"
		if err := PodUID(uid); err == nil {
			staysUnder(t, root, uid)
		} else if !errors.Is(err, ErrInvalid) {
			t.Fatalf("PodUID(%q) error %v does not wrap ErrInvalid", uid, err)
		}
		s := StandaloneUID(namespace, name)
		if err := PodUID(s); err != nil {
			t.Fatalf("StandaloneUID(%q, %q) = %q refused: %v", namespace, name, s, err)
		}
		staysUnder(t, root, s)
		if PodNames(namespace, name) == nil {
			for _, v := range []string{namespace, name} {
				if strings.ContainsAny(v, "/\x00") || v == "." || v == ".." {
					t.Fatalf("accepted pod %q/%q", namespace, name)
				}
				staysUnder(t, root, v)
			}
		}
	})
}

func staysUnder(t *testing.T, root, elem string) {
	t.Helper()
	if strings.ContainsAny(elem, "/\x00") || filepath.Dir(filepath.Join(root, elem)) != root {
		t.Fatalf("accepted %q leaves %s", elem, root)
	}
}

// An accepted interface or container ID is one path element without NUL or
// whitespace.
func FuzzInterfaceAndContainerID(f *testing.F) {
	for _, s := range hostile {
		f.Add(s)
	}
	f.Add("eth0")
	f.Add("4a1c7b0e9f3d")
	f.Fuzz(func(t *testing.T, s string) {
		if Interface(s) == nil {
			if len(s) > MaxInterfaceLen || strings.ContainsAny(s, "/: \t\n\x00") {
				t.Fatalf("accepted interface %q", s)
			}
			staysUnder(t, "/sys/class/net", s)
		}
		if ContainerID(s) == nil {
			staysUnder(t, "/var/lib/cni/results", s)
		}
	})
}
