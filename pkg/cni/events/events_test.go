// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package events

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock"
	"github.com/ambient-ebpf/ambient-ebpf/internal/unixsock/unixsocktest"
	"github.com/ambient-ebpf/ambient-ebpf/pkg/api/cniv1"
)

type fakeHandler struct {
	mu      sync.Mutex
	adds    []*cniv1.PodAddRequest
	dels    []*cniv1.PodDelRequest
	addErr  error
	delay   time.Duration
	started chan struct{}
}

func (f *fakeHandler) PodAdd(ctx context.Context, req *cniv1.PodAddRequest) (AddResult, error) {
	f.mu.Lock()
	f.adds = append(f.adds, req)
	err, delay := f.addErr, f.delay
	f.mu.Unlock()
	if delay > 0 {
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return AddResult{}, ctx.Err()
		}
	}
	if err != nil {
		return AddResult{}, err
	}
	return AddResult{Enrolled: true, Reason: "pod labelled ambient"}, nil
}

func (f *fakeHandler) PodDel(_ context.Context, req *cniv1.PodDelRequest) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dels = append(f.dels, req)
	return nil
}

// start serves h on a fresh socket and returns its path; the server stops
// when the test ends.
func start(t *testing.T, h Handler, opts ...ServeOption) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "run", "cni.sock")
	ln, err := Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- ServeListener(ctx, ln, h, opts...) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return path
}

func client(t *testing.T, path string) *Client {
	t.Helper()
	c, err := NewClient(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func addReq() *cniv1.PodAddRequest {
	return &cniv1.PodAddRequest{
		Pod: &cniv1.Pod{Name: "web", Namespace: "demo", Uid: "u-1", ContainerId: "c1", Netns: "/var/run/netns/x", Interface: "eth0"},
		Ips: []string{"198.18.0.5", "fd00:198:18::5"},
	}
}

func TestPodAddAndDelReachTheHandler(t *testing.T) {
	h := &fakeHandler{}
	c := client(t, start(t, h))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.PodAdd(ctx, addReq())
	if err != nil {
		t.Fatalf("PodAdd: %v", err)
	}
	if !resp.GetEnrolled() || resp.GetReason() != "pod labelled ambient" {
		t.Errorf("response = %v", resp)
	}
	if err := c.PodDel(ctx, &cniv1.PodDelRequest{Pod: addReq().Pod}); err != nil {
		t.Fatalf("PodDel: %v", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.adds) != 1 || h.adds[0].GetPod().GetUid() != "u-1" || len(h.adds[0].GetIps()) != 2 {
		t.Errorf("adds = %v", h.adds)
	}
	if len(h.dels) != 1 || h.dels[0].GetPod().GetContainerId() != "c1" {
		t.Errorf("dels = %v", h.dels)
	}
}

// TestListenReplacesOnlyAStaleSocket: a dead agent's socket is replaced
// by a root-only one; a regular file, or ztunnel's live ZDS socket given
// as --cni-socket, is refused and left as it was.
func TestListenReplacesOnlyAStaleSocket(t *testing.T) {
	dir := t.TempDir()
	stale := filepath.Join(dir, "cni.sock")
	dead, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	dead.SetUnlinkOnClose(false)
	_ = dead.Close()
	ln, err := Listen(stale)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	defer ln.Close()
	fi, err := os.Stat(stale)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %v, want a 0600 socket", fi.Mode())
	}

	file := filepath.Join(dir, "file.sock")
	if err := os.WriteFile(file, []byte("not ours"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(file); !errors.Is(err, unixsock.ErrNotSocket) {
		t.Errorf("Listen over a regular file: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "not ours" {
		t.Errorf("the file now holds %q", b)
	}

	ztunnel := filepath.Join(dir, "ztunnel.sock")
	zl, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: ztunnel, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer zl.Close()
	if _, err := Listen(ztunnel); !errors.Is(err, unixsock.ErrInUse) {
		t.Errorf("Listen over a live ZDS socket: %v", err)
	}
	c, err := net.Dial("unixpacket", ztunnel)
	if err != nil {
		t.Fatalf("the ZDS socket no longer answers: %v", err)
	}
	_ = c.Close()
}

func TestClientErrorsSayWhichFailClosedCaseHappened(t *testing.T) {
	cases := []struct {
		name    string
		path    func(t *testing.T) string
		timeout time.Duration
		want    []error
	}{
		{
			name:    "no socket",
			path:    func(t *testing.T) string { return filepath.Join(t.TempDir(), "missing.sock") },
			timeout: 2 * time.Second,
			want:    []error{ErrAgentUnreachable},
		},
		{
			name:    "agent too slow",
			path:    func(t *testing.T) string { return start(t, &fakeHandler{delay: 10 * time.Second}) },
			timeout: 200 * time.Millisecond,
			want:    []error{ErrAgentTimeout},
		},
		{
			name: "no ztunnel",
			path: func(t *testing.T) string {
				return start(t, &fakeHandler{addErr: fmt.Errorf("pod demo/web: %w", ErrNoZtunnel)})
			},
			timeout: 2 * time.Second,
			want:    []error{ErrNotEnrolled, ErrNoZtunnel},
		},
		{
			name: "dataplane error",
			path: func(t *testing.T) string {
				return start(t, &fakeHandler{addErr: errors.New("attach tcx to eth0: boom")})
			},
			timeout: 2 * time.Second,
			want:    []error{ErrNotEnrolled},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := client(t, tc.path(t))
			ctx, cancel := context.WithTimeout(context.Background(), tc.timeout)
			defer cancel()
			_, err := c.PodAdd(ctx, addReq())
			for _, w := range tc.want {
				if !errors.Is(err, w) {
					t.Errorf("PodAdd error = %v, want it to wrap %v", err, w)
				}
			}
		})
	}
}

func TestRequestWithoutPodIsRefused(t *testing.T) {
	h := &fakeHandler{}
	c := client(t, start(t, h))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.PodAdd(ctx, &cniv1.PodAddRequest{}); !errors.Is(err, ErrNotEnrolled) {
		t.Errorf("PodAdd without pod: %v, want ErrNotEnrolled", err)
	}
	if len(h.adds) != 0 {
		t.Errorf("handler saw %d adds", len(h.adds))
	}
}

// TestProbeNeedsAnAnswerInTime: Probe passes for a serving agent and fails
// for a missing socket and, within its deadline, for one that accepts the
// connection but never answers.
func TestProbeNeedsAnAnswerInTime(t *testing.T) {
	probe := func(path string) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := Probe(ctx, path)
		return time.Since(start), err
	}
	if _, err := probe(start(t, &fakeHandler{})); err != nil {
		t.Errorf("Probe of a serving agent: %v", err)
	}
	if _, err := probe(filepath.Join(t.TempDir(), "missing.sock")); !errors.Is(err, ErrAgentUnreachable) {
		t.Errorf("Probe of a missing socket: %v", err)
	}
	took, err := probe(unixsocktest.Mute(t))
	if !errors.Is(err, ErrAgentTimeout) {
		t.Errorf("Probe of an agent that never answers: %v", err)
	}
	if took > 2*time.Second {
		t.Errorf("Probe took %v with a 300ms deadline", took)
	}
}

// panicky panics in PodAdd.
type panicky struct{ fakeHandler }

func (*panicky) PodAdd(context.Context, *cniv1.PodAddRequest) (AddResult, error) {
	panic("handler exploded")
}

// TestPanicInAHandlerFailsOnlyThatCall: the call gets an error, the server
// keeps serving.
func TestPanicInAHandlerFailsOnlyThatCall(t *testing.T) {
	c := client(t, start(t, &panicky{}))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.PodAdd(ctx, addReq()); !errors.Is(err, ErrNotEnrolled) || !strings.Contains(err.Error(), "handler exploded") {
		t.Fatalf("PodAdd into a panicking handler: %v", err)
	}
	if err := c.PodDel(ctx, &cniv1.PodDelRequest{Pod: addReq().Pod}); err != nil {
		t.Fatalf("PodDel after the panic: %v", err)
	}
}

// The observer hears each ADD and DEL with the code of its answer: OK,
// InvalidArgument for a malformed request, Internal for a panic.
func TestObserverHearsEachAnswer(t *testing.T) {
	type call struct {
		method string
		code   codes.Code
	}
	var mu sync.Mutex
	var got []call
	observe := WithObserver(func(m string, c codes.Code) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, call{m, c})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := client(t, start(t, &fakeHandler{}, observe))
	_, _ = c.PodAdd(ctx, addReq())
	bad := addReq()
	bad.Pod.Name = "../x"
	_, _ = c.PodAdd(ctx, bad)
	_ = c.PodDel(ctx, &cniv1.PodDelRequest{Pod: addReq().Pod})
	_, _ = client(t, start(t, &panicky{}, observe)).PodAdd(ctx, addReq())

	mu.Lock()
	defer mu.Unlock()
	want := []call{{"add", codes.OK}, {"add", codes.InvalidArgument}, {"del", codes.OK}, {"add", codes.Internal}}
	if !slices.Equal(got, want) {
		t.Errorf("observed %v, want %v", got, want)
	}
}
