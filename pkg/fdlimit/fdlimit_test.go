// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package fdlimit

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestCheckRefusesBelowBaseAndWarnsBelowTheNeed(t *testing.T) {
	const pods = 8192
	cases := []struct {
		name    string
		limit   Limit
		warn    []string // what the warning names
		refused bool
	}{
		{name: "ample", limit: Limit{Soft: 1 << 20, Hard: 1 << 20}},
		{name: "exactly the need", limit: Limit{Soft: Need(pods), Hard: Need(pods)}},
		// The node: 20000 held 2844 pods with seven descriptors
		// each, and now holds them all.
		{name: "the issue's 20000", limit: Limit{Soft: 20000, Hard: 20000}},
		{name: "short", limit: Limit{Soft: 4096, Hard: 4096},
			warn: []string{"RLIMIT_NOFILE is 4096", "below the 9216", "8192 pods", "about 3072 pods can", "LimitNOFILE", "at least 9216"}},
		{name: "below base", limit: Limit{Soft: 512, Hard: 512}, refused: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			warning, err := Check(tc.limit, pods)
			if tc.refused {
				if !errors.Is(err, ErrTooLow) || !strings.Contains(err.Error(), "RLIMIT_NOFILE is 512") || !strings.Contains(err.Error(), fmt.Sprint(Base)) {
					t.Fatalf("Check = %q, %v; want a refusal naming the limit and the need", warning, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Check: %v", err)
			}
			if len(tc.warn) == 0 && warning != "" {
				t.Errorf("warning %q, want none", warning)
			}
			for _, w := range tc.warn {
				if !strings.Contains(warning, w) {
					t.Errorf("warning %q does not say %q", warning, w)
				}
			}
		})
	}
}

// Raise lifts the soft limit to the hard one.
func TestRaiseLiftsTheSoftLimitToTheHardOne(t *testing.T) {
	var orig unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &orig) })
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: Base, Max: orig.Max}); err != nil {
		t.Fatal(err)
	}
	got, err := Raise()
	if err != nil {
		t.Fatal(err)
	}
	if got.Soft != orig.Max || got.Hard != orig.Max {
		t.Errorf("Raise = %+v, want soft and hard %d", got, orig.Max)
	}
}

func TestAnnotateNamesTheLimit(t *testing.T) {
	var l unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &l); err != nil {
		t.Fatal(err)
	}
	emfile := fmt.Errorf("pod default/a: open netns: %w", &fs.PathError{Op: "open", Path: "/proc/1/ns/net", Err: unix.EMFILE})
	got := Annotate(emfile)
	if !errors.Is(got, unix.EMFILE) || !strings.Contains(got.Error(), fmt.Sprintf("RLIMIT_NOFILE, of %d", l.Cur)) || !strings.HasPrefix(got.Error(), emfile.Error()) {
		t.Errorf("Annotate(EMFILE) = %v", got)
	}
	if got := Annotate(fmt.Errorf("x: %w", unix.ENFILE)); !strings.Contains(got.Error(), "fs.file-max") {
		t.Errorf("Annotate(ENFILE) = %v", got)
	}
	other := errors.New("no such pod")
	if got := Annotate(other); got != other {
		t.Errorf("Annotate changed %v to %v", other, got)
	}
	if Annotate(nil) != nil {
		t.Error("Annotate(nil) is not nil")
	}
}
