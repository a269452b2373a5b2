// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package simnode

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"github.com/ambient-ebpf/ambient-ebpf/internal/testbin"
)

// HelperEnv selects a helper role when the test binary re-executes itself.
const HelperEnv = "AMBIENT_EBPF_HELPER"

// Proc is a helper process (the test binary re-executed in a role) running
// in a netns and cgroup, driven by JSON lines on stdin and stdout.
type Proc struct {
	t      TB
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	mu     sync.Mutex
	Stderr *lockedBuffer
}

// StartHelper starts the test binary in role inside netns ns (a name under
// /run/netns) and cgroup dir (empty: the caller's). extraEnv adds
// environment. The process is killed by PID at cleanup.
func StartHelper(t TB, role, ns, cgroup string, extraEnv ...string) *Proc {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// nsenter switches only the network namespace, so /sys and bpffs
	// mounts stay as they are (unlike `ip netns exec`).
	cmd := exec.Command("nsenter", "--net="+NetnsPath(ns), self)
	cmd.Env = append(append(os.Environ(), HelperEnv+"="+role), extraEnv...)
	defer startInCgroup(t, cmd, cgroup)()
	p := &Proc{t: t, cmd: cmd, Stderr: &lockedBuffer{}}
	cmd.Stderr = p.Stderr
	if p.in, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.out = bufio.NewScanner(stdout)
	p.out.Buffer(make([]byte, 64*1024), 4*1024*1024)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start helper %s: %v", role, err)
	}
	t.Cleanup(p.Stop)
	var ready struct{ Ready bool }
	if err := p.read(&ready); err != nil || !ready.Ready {
		t.Fatalf("helper %s did not start: %v; stderr:\n%s", role, err, p.Stderr.String())
	}
	return p
}

// Call sends req and decodes the reply into resp.
func (p *Proc) Call(req, resp any) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("write to helper: %w; stderr:\n%s", err, p.Stderr.String())
	}
	return p.read(resp)
}

func (p *Proc) read(v any) error {
	if !p.out.Scan() {
		return fmt.Errorf("helper exited: %v; stderr:\n%s", p.out.Err(), p.Stderr.String())
	}
	return json.Unmarshal(p.out.Bytes(), v)
}

// PID returns the helper's process id.
func (p *Proc) PID() int { return p.cmd.Process.Pid }

// Stop kills the helper (by its PID) and waits for it.
func (p *Proc) Stop() {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.in.Close()
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.b = append(l.b, p...)
	return len(p), nil
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return string(l.b)
}

func sleepShort() { time.Sleep(10 * time.Millisecond) }

// Process is a program (not a helper role) running in a netns and cgroup.
type Process struct {
	t      TB
	cmd    *exec.Cmd
	done   chan struct{}
	Output *lockedBuffer
}

// StartProcess runs argv in netns ns ("" for the caller's) and cgroup dir.
// It is ended by PID at cleanup (SIGTERM, then SIGKILL).
func StartProcess(t TB, ns, cgroup string, argv ...string) *Process {
	t.Helper()
	return startProcess(t, ns, cgroup, nil, argv...)
}

// startProcess is StartProcess, run as cred's user when not nil.
func startProcess(t TB, ns, cgroup string, cred *syscall.Credential, argv ...string) *Process {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	if ns != "" {
		cmd = exec.Command("nsenter", append([]string{"--net=" + NetnsPath(ns), "--"}, argv...)...)
	}
	p := &Process{t: t, cmd: cmd, done: make(chan struct{}), Output: &lockedBuffer{}}
	cmd.Stdout, cmd.Stderr = p.Output, p.Output
	defer startInCgroup(t, cmd, cgroup)()
	if cred != nil {
		if cmd.SysProcAttr == nil {
			cmd.SysProcAttr = &syscall.SysProcAttr{}
		}
		cmd.SysProcAttr.Credential = cred
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", argv[0], err)
	}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.Terminate(5 * time.Second) })
	return p
}

// PID returns the process id (nsenter execs the program in place, so it is
// the program's).
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Kill ends the process with SIGKILL and waits.
func (p *Process) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// Terminate sends SIGTERM and waits up to grace, then kills. It reports
// whether the process exited on its own with status 0.
func (p *Process) Terminate(grace time.Duration) bool {
	select {
	case <-p.done:
		return p.cmd.ProcessState.Success()
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return p.cmd.ProcessState.Success()
	case <-time.After(grace):
		p.Kill()
		return false
	}
}

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// BuildBinary builds a main package of this module (with build tags, if
// any) into dir, stamped with the version `make build` stamps; under
// hack/vmtest it is the prebuilt one (internal/testbin).
func BuildBinary(t TB, dir, pkg string, tags ...string) string {
	t.Helper()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := testbin.Root(wd)
	if os.Getenv(testbin.PrebuiltEnv) != "" {
		root, err = wd, nil // no source tree in the VM
	}
	if err != nil {
		t.Fatal(err)
	}
	out, err := testbin.Head(root, dir, pkg, tags...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// startInCgroup makes cmd start in cgroup dir (if any) and returns what
// closes the cgroup's fd once the process started. No Pdeathsig: it fires
// when the forking OS thread exits, and threads locked into a netns do
// exit. The cgroup is the leash: its cleanup kills whatever is left in it.
func startInCgroup(t TB, cmd *exec.Cmd, cgroup string) (closeFD func()) {
	t.Helper()
	if cgroup == "" {
		return func() {}
	}
	fd, err := syscall.Open(cgroup, syscall.O_DIRECTORY|syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open cgroup %s: %v", cgroup, err)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	return func() { syscall.Close(fd) }
}
