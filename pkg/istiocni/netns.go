// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package istiocni

import (
	"context"
	"fmt"
	"os/exec"
	"runtime"
	"strings"

	"github.com/vishvananda/netns"
)

// inNetns runs fn on an OS thread switched into the netns at path; the
// commands fn starts inherit that thread's netns. The thread is locked
// for the duration and returned to its own netns after; if that fails it
// stays locked and Go ends it with the goroutine.
func inNetns(path string, fn func() error) error {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer target.Close()
	return onThread(func() error { return netns.Set(target) }, path, fn)
}

// inScratchNetns runs fn in a new, empty netns of its own, gone when fn
// returns: where the expected rules are applied and read back, so they
// are compared in the form the installed iptables or nft prints them.
func inScratchNetns(fn func() error) error {
	return onThread(func() error {
		ns, err := netns.New() // unshare(CLONE_NEWNET) on this thread
		if err != nil {
			return err
		}
		return ns.Close()
	}, "a scratch netns", fn)
}

func onThread(enter func() error, what string, fn func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("own netns: %w", err)
	}
	defer orig.Close()
	if err := enter(); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter %s: %w", what, err)
	}
	fnErr := fn()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("return from %s: %w", what, err)
	}
	runtime.UnlockOSThread()
	return fnErr
}

// run runs a tool on the calling (netns-switched) thread; its error names
// the netns and the command line.
func run(ctx context.Context, where, stdin, tool string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, tool, args...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if stdin != "" {
			msg += "; input:\n" + stdin
		}
		return string(out), fmt.Errorf("netns %s: %s %s: %w: %s", where, tool, strings.Join(args, " "), err, msg)
	}
	return string(out), nil
}
