// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

//go:build bench

package bench

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"
)

// stackSampler is a poor man's off-CPU profiler: it reads the kernel
// stacks of every thread of a process every few milliseconds and counts
// where the threads that are inside a system call wait. It shows what a
// CPU profile cannot, time spent blocked in the kernel (RCU grace
// periods, locks), which is what bounds enrollment.
type stackSampler struct {
	pid     int
	stop    chan struct{}
	done    chan struct{}
	counts  map[string]int
	samples int
}

// idle stacks: Go runtime threads parked, the helper reading stdin.
var idleStack = regexp.MustCompile(`futex_wait|ep_poll|do_epoll_wait|do_nanosleep|pipe_read|hrtimer_nanosleep`)

var stackOffset = regexp.MustCompile(`\+0x[0-9a-f]+/0x[0-9a-f]+`)

func startStackSampler(pid int) *stackSampler {
	s := &stackSampler{pid: pid, stop: make(chan struct{}), done: make(chan struct{}), counts: map[string]int{}}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-s.stop:
				return
			case <-tick.C:
				s.sample()
			}
		}
	}()
	return s
}

func (s *stackSampler) sample() {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stack", s.pid))
	s.samples++
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil || len(b) == 0 || idleStack.Match(b) {
			continue
		}
		s.counts[signature(string(b))]++
	}
}

// signature names a stack by its first frames below the scheduler, up to
// the system call.
func signature(stack string) string {
	var frames []string
	for l := range strings.Lines(stack) {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		name := stackOffset.ReplaceAllString(f[1], "")
		if strings.Contains(name, "schedule") || strings.HasPrefix(name, "wait_for_completion") || strings.HasPrefix(name, "__wait_for_common") {
			continue
		}
		if strings.HasPrefix(name, "do_syscall") || strings.HasPrefix(name, "entry_SYSCALL") {
			break
		}
		frames = append(frames, name)
		if len(frames) == 4 {
			break
		}
	}
	return strings.Join(frames, " < ")
}

// finish stops sampling and returns the top stacks with their share of
// the samples (a share of 1 is one thread there for the whole time).
func (s *stackSampler) finish(top int) string {
	close(s.stop)
	<-s.done
	type kv struct {
		k string
		v int
	}
	var all []kv
	for k, v := range s.counts {
		all = append(all, kv{k, v})
	}
	slices.SortFunc(all, func(a, b kv) int { return cmp.Compare(b.v, a.v) })
	var parts []string
	for i, e := range all {
		if i == top {
			break
		}
		parts = append(parts, fmt.Sprintf("%.0f%% %s", 100*float64(e.v)/float64(max(s.samples, 1)), e.k))
	}
	return fmt.Sprintf("%d samples; %s", s.samples, strings.Join(parts, "; "))
}
