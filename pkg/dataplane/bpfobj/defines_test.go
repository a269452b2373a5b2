// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package bpfobj

import (
	"regexp"
	"strconv"
	"testing"

	"github.com/ambient-ebpf/ambient-ebpf/bpf/include"
)

// The C side's #define constants are copied into Go by hand (bpf2go
// generates types and enums, not macros); this holds the copies to
// bpf/include/common.h, so a change on one side fails here instead of on a node.
func TestConstantsMatchCommonH(t *testing.T) {
	defines := parseDefines(t, include.CommonH)
	for name, got := range map[string]uint64{
		"AE_F_HAS_V4":                 FlagHasV4,
		"AE_F_HAS_V6":                 FlagHasV6,
		"AE_F_BYPASS_INBOUND":         FlagBypassInbound,
		"AE_F_DNS_CAPTURE":            FlagDNSCapture,
		"AE_MAX_PODS":                 MaxPods,
		"AE_LISTENER_SLOTS":           ListenerSlots,
		"AE_CFG_NETNS_COOKIE_SOCKOPS": CfgNetnsCookieSockops,
		"AE_CFG_NETNS_COOKIE_SOCKOPT": CfgNetnsCookieSockopt,
		"AE_CFG_SK_ASSIGN_REUSEPORT":  CfgSkAssignReuseport,
		"AE_CFG_SK_LOOKUP_IFINDEX":    CfgSkLookupIfindex,
		"AE_CFG_PROBE_DIRECT":         CfgProbeDirect,
		"AE_CFG_NODE_SCOPE":           CfgNodeScope,
		"AE_CFG_PROBE_CONNECT":        CfgProbeConnect,
		"AE_PROBE_FLOW_TTL_NS":        uint64(ProbeFlowTTL),
		"AE_META_FREE":                MetaFree,
		"AE_META_ENROLLED":            MetaEnrolled,
		"AE_META_ENROLLING":           MetaEnrolling,
		"AE_META_REMOVING":            MetaRemoving,
		"AE_TRACE_LOST":               TraceLost,
	} {
		want, ok := defines[name]
		if !ok {
			t.Errorf("%s: not defined in bpf/include/common.h (or not in a form this test reads)", name)
			continue
		}
		if got != want {
			t.Errorf("%s: Go has %d, bpf/include/common.h %d", name, got, want)
		}
	}
}

// parseDefines reads the forms common.h uses: a number, (1U << n), and
// (OTHER - n) for a name defined earlier.
func parseDefines(t *testing.T, src string) map[string]uint64 {
	t.Helper()
	line := regexp.MustCompile(`(?m)^#define\s+(AE_\w+)\s+(.+?)\s*(?:/\*.*)?$`)
	shift := regexp.MustCompile(`^\(1U?\s*<<\s*(\d+)\)$`)
	minus := regexp.MustCompile(`^\((AE_\w+)\s*-\s*(\d+)\)$`)
	out := map[string]uint64{}
	for _, m := range line.FindAllStringSubmatch(src, -1) {
		name, expr := m[1], m[2]
		switch {
		case shift.MatchString(expr):
			n, _ := strconv.Atoi(shift.FindStringSubmatch(expr)[1])
			out[name] = 1 << n
		case minus.MatchString(expr):
			sm := minus.FindStringSubmatch(expr)
			base, ok := out[sm[1]]
			if !ok {
				t.Fatalf("#define %s: %s is not defined before it", name, sm[1])
			}
			n, _ := strconv.ParseUint(sm[2], 10, 64)
			out[name] = base - n
		default:
			v, err := strconv.ParseUint(expr, 0, 64)
			if err != nil {
				v, err = strconv.ParseUint(regexp.MustCompile(`[uUlL]+$`).ReplaceAllString(expr, ""), 0, 64)
			}
			if err == nil {
				out[name] = v
			}
		}
	}
	return out
}
