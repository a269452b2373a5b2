// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build !linux

package features

// Off Linux there is no kernel to probe: every feature is missing.
func missing() bool { return false }

var (
	HasTCX                 = missing
	HasSkLookupIfindex     = missing
	HasSkAssign            = missing
	HasSkLookup            = missing
	HasNetnsCookieSockAddr = missing
	HasCgroupGetpeername   = missing
	HasSkStorageSockAddr   = missing
	HasSkStorageSockops    = missing
	HasSONetnsCookie       = missing
	HasNetnsCookieSockops  = missing
	HasNetnsCookieSockopt  = missing
	HasSockmapAccel        = missing
	HasSockmapLink         = missing
	HasFentryTCPConnect    = missing
)
