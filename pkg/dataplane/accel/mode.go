// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package accel

import "fmt"

// Mode says which sends of the app <-> ztunnel hop skip TCP.
type Mode string

// The sockmap acceleration's modes.
const (
	// Off: every byte of the hop is TCP over the pod's lo.
	Off Mode = "off"
	// ToZtunnel: the app's sends into ztunnel skip TCP; ztunnel's
	// into the app do not. Apps receive as without it, so any app works.
	ToZtunnel Mode = "ztunnel"
	// Both: ztunnel's sends into the app skip TCP too. An app that
	// reads its sockets with splice(2) (Go's io.Copy from one TCP
	// connection to another, HAProxy's splicing) or sizes reads with
	// FIONREAD does not see those bytes: only recv and read do.
	Both Mode = "both"
)

// ParseMode reads a mode as the agent's --sockmap-accel takes it.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Off, ToZtunnel, Both:
		return m, nil
	case "":
		return Off, nil
	}
	return "", fmt.Errorf("sockmap acceleration %q: want off, ztunnel or both", s)
}

// On reports whether the mode accelerates anything.
func (m Mode) On() bool { return m == ToZtunnel || m == Both }
