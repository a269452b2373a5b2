// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package validate checks the strings that name a pod, its sandbox and its
// interfaces where they enter the agent or the CNI plugin: the standalone pod
// file, objects from the API server, CNI_ARGS and the CNI environment, and
// the plugin's gRPC calls. A pod UID names the pod's pin directory
// (pods/<uid>/ under the bpffs root), so nothing that fails these checks may
// reach the dataplane.
//
// The rules are Kubernetes' and Linux's own, so no real pod is refused:
//
//   - namespace: a DNS-1123 label (at most 63 bytes of [a-z0-9-]);
//   - pod name: a DNS-1123 subdomain (at most 253 bytes of [a-z0-9.-]);
//   - pod UID: 1 to 39 bytes of [A-Za-z0-9._-], neither "." nor "..".
//     Kubernetes UIDs are UUIDs (36 bytes) and fit; 39 bytes is what the
//     dataplane's pod metadata stores. Standalone pods without a UID get
//     StandaloneUID, which fits too;
//   - container ID: the CNI spec's rule, [A-Za-z0-9] then [A-Za-z0-9._-],
//     at most 255 bytes (runtimes use it in file names);
//   - interface name: Linux's rule (dev_valid_name) as libcni applies it,
//     1 to 15 bytes, neither "." nor "..", no '/', ':' or whitespace; control
//     characters are refused too;
//   - netns path: an absolute path without NUL of at most 4095 bytes.
//
// Every error wraps ErrInvalid and names the field and the value.
package validate

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"unicode"
)

// ErrInvalid is wrapped by every error of this package.
var ErrInvalid = errors.New("invalid pod name, uid, id or path")

// Limits of the rules above.
const (
	MaxUIDLen         = 39
	MaxContainerIDLen = 255
	MaxInterfaceLen   = 15
	MaxNetnsPathLen   = 4095
)

// StandalonePrefix starts the UID StandaloneUID derives.
const StandalonePrefix = "standalone-"

// Error is a refused value: the field, the value as given, and why.
type Error struct {
	Field  string
	Value  string
	Reason string
}

// maxShown bounds how much of a refused value an error message repeats.
const maxShown = 64

func (e *Error) Error() string {
	v := e.Value
	if len(v) > maxShown {
		return fmt.Sprintf("invalid %s %q... (%d bytes): %s", e.Field, v[:maxShown], len(v), e.Reason)
	}
	return fmt.Sprintf("invalid %s %q: %s", e.Field, v, e.Reason)
}

// Is makes errors.Is(err, ErrInvalid) hold for every *Error.
func (e *Error) Is(target error) bool { return target == ErrInvalid }

func refuse(field, value, reason string) error {
	return &Error{Field: field, Value: value, Reason: reason}
}

// Namespace checks a pod's namespace (a DNS-1123 label).
func Namespace(ns string) error {
	if why := dns1123Label(ns); why != "" {
		return refuse("pod namespace", ns, why)
	}
	return nil
}

// PodName checks a pod's name (a DNS-1123 subdomain).
func PodName(name string) error {
	if why := dns1123Subdomain(name); why != "" {
		return refuse("pod name", name, why)
	}
	return nil
}

// The DNS-1123 rules are Kubernetes' (k8s.io/apimachinery's
// IsDNS1123Label and IsDNS1123Subdomain accept exactly what these accept:
// TestDNS1123AgreesWithKubernetes, FuzzDNS1123), written here because the
// CNI plugin imports this package: apimachinery's validation brings klog
// and initialisers that took 6% of the plugin's CPU per ADD.
const (
	dns1123LabelMax     = 63
	dns1123SubdomainMax = 253
)

// dns1123Label says why s is not a DNS-1123 label, or "".
func dns1123Label(s string) string {
	if len(s) > dns1123LabelMax {
		return fmt.Sprintf("must be no more than %d bytes", dns1123LabelMax)
	}
	if !isLabel(s) {
		return "must be a lowercase DNS-1123 label: [a-z0-9] and '-', starting and ending with [a-z0-9]"
	}
	return ""
}

// dns1123Subdomain says why s is not a DNS-1123 subdomain, or "".
func dns1123Subdomain(s string) string {
	if len(s) > dns1123SubdomainMax {
		return fmt.Sprintf("must be no more than %d bytes", dns1123SubdomainMax)
	}
	for l := range strings.SplitSeq(s, ".") {
		if !isLabel(l) {
			return "must be a lowercase DNS-1123 subdomain: labels of [a-z0-9] and '-', starting and ending with [a-z0-9], joined by '.'"
		}
	}
	return ""
}

// isLabel reports whether s is [a-z0-9]([-a-z0-9]*[a-z0-9])? (any length).
func isLabel(s string) bool {
	if s == "" || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

// PodUID checks a pod's UID: it must be usable as one file name.
func PodUID(uid string) error {
	return element("pod uid", uid, MaxUIDLen, safeChar, "is not one of [A-Za-z0-9._-]")
}

// Pod checks a pod's namespace, name and UID.
func Pod(namespace, name, uid string) error {
	if err := PodNames(namespace, name); err != nil {
		return err
	}
	return PodUID(uid)
}

// PodNames checks a pod's namespace and name, for callers that may not know
// its UID yet.
func PodNames(namespace, name string) error {
	if err := Namespace(namespace); err != nil {
		return err
	}
	return PodName(name)
}

// ContainerID checks a CNI container (sandbox) ID.
func ContainerID(id string) error {
	return containerID("container id", id)
}

// InfraContainerID checks K8S_POD_INFRA_CONTAINER_ID, which follows the
// container ID rule.
func InfraContainerID(id string) error {
	return containerID("infra container id", id)
}

func containerID(field, id string) error {
	if id != "" && !alnum(rune(id[0])) {
		return refuse(field, id, "must start with [A-Za-z0-9]")
	}
	return element(field, id, MaxContainerIDLen, safeChar, "is not one of [A-Za-z0-9._-]")
}

// Interface checks a network interface name.
func Interface(name string) error {
	return element("interface name", name, MaxInterfaceLen, ifnameChar, "is '/', ':', whitespace, a control character or not UTF-8")
}

// element checks value as one path element: not empty, at most maxLen bytes,
// neither "." nor "..", every rune passing ok (why says what a rune that
// fails is). Invalid UTF-8 fails ok as utf8.RuneError.
func element(field, value string, maxLen int, ok func(rune) bool, why string) error {
	switch {
	case value == "":
		return refuse(field, value, "must not be empty")
	case len(value) > maxLen:
		return refuse(field, value, fmt.Sprintf("must be at most %d bytes", maxLen))
	case value == "." || value == "..":
		return refuse(field, value, `must not be "." or ".."`)
	}
	if i := strings.IndexFunc(value, func(r rune) bool { return !ok(r) }); i >= 0 {
		return refuse(field, value, fmt.Sprintf("byte %d %s", i, why))
	}
	return nil
}

// NetnsPath checks a network namespace path such as CNI_NETNS.
func NetnsPath(path string) error {
	const field = "netns path"
	switch {
	case path == "":
		return refuse(field, path, "must not be empty")
	case len(path) > MaxNetnsPathLen:
		return refuse(field, path, fmt.Sprintf("must be at most %d bytes", MaxNetnsPathLen))
	case path[0] != '/':
		return refuse(field, path, "must be absolute")
	case strings.IndexByte(path, 0) >= 0:
		return refuse(field, path, "must not contain NUL")
	}
	return nil
}

// StandaloneUID is the UID of a standalone pod file entry without
// metadata.uid: "standalone-" and the first 28 hex digits of the SHA-256 of
// "<namespace>/<name>", 39 bytes (unambiguous: a valid namespace holds no
// '/'). It is stable per namespace/name and always passes PodUID, whatever
// the names hold.
func StandaloneUID(namespace, name string) string {
	sum := sha256.Sum256([]byte(namespace + "/" + name))
	return StandalonePrefix + hex.EncodeToString(sum[:])[:MaxUIDLen-len(StandalonePrefix)]
}

func alnum(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9'
}

func safeChar(r rune) bool { return alnum(r) || r == '.' || r == '_' || r == '-' }

func ifnameChar(r rune) bool {
	return r != '/' && r != ':' && r != unicode.ReplacementChar && !unicode.IsSpace(r) && !unicode.IsControl(r)
}
