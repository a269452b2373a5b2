// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

// Package fdlimit weighs the process's open file limit (RLIMIT_NOFILE)
// against what the agent needs for its pod capacity, and names the limit
// in the errors of running out of descriptors, which otherwise say only
// "too many open files" about whatever pod hit it.
//
// The data path holds no descriptor per enrolled pod (pins hold the pods'
// programs and links), so the need is the agent's own descriptors plus
// one per pod whose CNI request is in flight: all of them at once when a
// node with every pod slot in use starts up again.
package fdlimit

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

const (
	// Base is what the agent needs with no pod, with room to spare: the
	// data path's loaded maps, programs and node-wide links (about 80),
	// its servers, clients and watches (about 30), and the few that one
	// operation opens while it runs (a netns, a netlink socket, a clone
	// of a program to pin). Below it the agent does not start.
	Base = 1024
	// PerPod is for each pod of the capacity: the connection of its CNI
	// request, when every pod starts at once.
	PerPod = 1
)

// Need returns the descriptors an agent for pods pods needs.
func Need(pods int) uint64 { return Base + PerPod*uint64(pods) }

// Limit is RLIMIT_NOFILE.
type Limit struct{ Soft, Hard uint64 }

// Raise lifts the soft limit to the hard one, as most daemons do (the Go
// runtime does too, where it can), and returns the limit then in force.
// Processes the agent starts keep the Go runtime's choice.
func Raise() (Limit, error) {
	var l unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &l); err != nil {
		return Limit{}, fmt.Errorf("getrlimit RLIMIT_NOFILE: %w", err)
	}
	if l.Cur < l.Max {
		raised := unix.Rlimit{Cur: l.Max, Max: l.Max}
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &raised); err != nil {
			return Limit{Soft: l.Cur, Hard: l.Max}, fmt.Errorf("raise RLIMIT_NOFILE from %d to the hard limit %d: %w", l.Cur, l.Max, err)
		}
		l = raised
	}
	return Limit{Soft: l.Cur, Hard: l.Max}, nil
}

// ErrTooLow is a limit below Base: the agent would run out of descriptors
// part way through loading or adopting the data path.
var ErrTooLow = errors.New("open file limit too low")

// Check weighs l against an agent for pods pods. Below Base it returns
// ErrTooLow; below the need of every pod starting at once it returns a
// warning for the log (the node may run far fewer pods than the data
// path's capacity, and runs until then); otherwise "".
func Check(l Limit, pods int) (warning string, err error) {
	need := Need(pods)
	switch {
	case l.Soft < Base:
		return "", fmt.Errorf("%w: RLIMIT_NOFILE is %d (hard %d), the agent needs at least %d, and %d for %d pods; raise the container runtime's limit (LimitNOFILE in containerd's or CRI-O's systemd unit)",
			ErrTooLow, l.Soft, l.Hard, Base, need, pods)
	case l.Soft < need:
		return fmt.Sprintf("RLIMIT_NOFILE is %d (hard %d), below the %d descriptors that %d pods starting at once need (%d + %d a pod): about %d pods can; raise the container runtime's limit (LimitNOFILE in containerd's or CRI-O's systemd unit) to at least %d",
			l.Soft, l.Hard, need, pods, Base, PerPod, (l.Soft-Base)/PerPod, need), nil
	}
	return "", nil
}

// Annotate names the limit in an error of running out of descriptors
// (EMFILE: this process's; ENFILE: the system's). Other errors, and nil,
// are returned as they are.
func Annotate(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EMFILE):
		var l unix.Rlimit
		if unix.Getrlimit(unix.RLIMIT_NOFILE, &l) != nil {
			return fmt.Errorf("%w (the open file limit, RLIMIT_NOFILE, is reached)", err)
		}
		return fmt.Errorf("%w (the open file limit, RLIMIT_NOFILE, of %d is reached: raise the container runtime's LimitNOFILE)", err, l.Cur)
	case errors.Is(err, unix.ENFILE):
		return fmt.Errorf("%w (the system's open file limit, fs.file-max, is reached)", err)
	}
	return err
}
