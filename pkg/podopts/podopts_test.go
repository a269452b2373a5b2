// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package podopts

import "testing"

func TestEqualComparesRerouteInterfacesInOrder(t *testing.T) {
	a := Options{DNSCapture: true, RerouteInterfaces: []string{"tun0", "wg0"}}
	if !a.Equal(a.Clone()) {
		t.Errorf("%v differs from its clone", a)
	}
	if a.Equal(Options{DNSCapture: true, RerouteInterfaces: []string{"wg0", "tun0"}}) {
		t.Error("reroute interfaces in another order compare equal")
	}
	if a.Equal(Options{RerouteInterfaces: a.RerouteInterfaces}) || a.Equal(Options{DNSCapture: true, BypassInbound: true, RerouteInterfaces: a.RerouteInterfaces}) {
		t.Error("options that differ in a switch compare equal")
	}
	c := a.Clone()
	c.RerouteInterfaces[0] = "x"
	if a.RerouteInterfaces[0] != "tun0" {
		t.Error("a clone shares its reroute list")
	}
}
