// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package events

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

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
		code   cniv1.Code
	}
	var mu sync.Mutex
	var got []call
	observe := WithObserver(func(m string, c cniv1.Code) {
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
	want := []call{{"add", cniv1.CodeOK}, {"add", cniv1.CodeInvalidArgument}, {"del", cniv1.CodeOK}, {"add", cniv1.CodeInternal}}
	if !slices.Equal(got, want) {
		t.Errorf("observed %v, want %v", got, want)
	}
}

// exchange writes data to the agent at path as it is, then reads its
// answer.
func exchange(t *testing.T, path string, data []byte) error {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	return cniv1.ReadAnswer(c, nil)
}

func rawFrame(version byte, kind cniv1.Kind, body string) []byte {
	b := append([]byte(cniv1.Magic), version, byte(kind))
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

// A frame the format refuses is answered with an error that says why,
// never reaches the handler, and the agent goes on serving.
func TestBadFramesAreRefusedAndTheServerGoesOn(t *testing.T) {
	h := &fakeHandler{}
	var mu sync.Mutex
	var observed []cniv1.Code
	path := start(t, h, WithObserver(func(_ string, c cniv1.Code) {
		mu.Lock()
		defer mu.Unlock()
		observed = append(observed, c)
	}))
	oversized := binary.BigEndian.AppendUint32([]byte("AECN\x01A"), 1<<30)
	cases := []struct {
		name string
		data []byte
		code cniv1.Code
		says string
	}{
		{"a gRPC client (HTTP/2 preface)", []byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), cniv1.CodeInvalidArgument, `starts with "PRI "`},
		{"oversized", oversized, cniv1.CodeInvalidArgument, "1073741824 bytes, more than the 65536 allowed"},
		{"other version", rawFrame(9, cniv1.KindAdd, `{}`), cniv1.CodeUnsupportedVersion, "version 9, this end speaks 1"},
		{"unknown field", rawFrame(1, cniv1.KindAdd, `{"pod":{"name":"web","hostNetwork":true}}`), cniv1.CodeInvalidArgument, "hostNetwork"},
		{"not json", rawFrame(1, cniv1.KindDel, `{"pod":`), cniv1.CodeInvalidArgument, "del request"},
		{"answer kind", rawFrame(1, cniv1.KindResult, `{}`), cniv1.CodeInvalidArgument, "result is not a request"},
	}
	for _, tc := range cases {
		err := exchange(t, path, tc.data)
		if e, ok := errors.AsType[*cniv1.Error](err); !ok || e.Code != tc.code || !strings.Contains(e.Message, tc.says) {
			t.Errorf("%s: answer %v; want %s saying %q", tc.name, err, tc.code, tc.says)
		}
	}
	// A connection that sends nothing, or half a header, and hangs up.
	for _, data := range [][]byte{nil, []byte("AE")} {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write(data)
		_ = c.Close()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := client(t, path).PodAdd(ctx, addReq()); err != nil {
		t.Fatalf("PodAdd after the bad frames: %v", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.adds) != 1 || len(h.dels) != 0 {
		t.Errorf("handler saw adds %v, dels %v; want only the good add", h.adds, h.dels)
	}
	mu.Lock()
	defer mu.Unlock()
	// The refused add, del and version-9 add count as refusals (400).
	want := []cniv1.Code{cniv1.CodeUnsupportedVersion, cniv1.CodeInvalidArgument, cniv1.CodeInvalidArgument, cniv1.CodeOK}
	if !slices.Equal(observed, want) {
		t.Errorf("observed %v, want %v", observed, want)
	}
}

// An answer not in this format (an agent of a release that spoke gRPC
// starts with an HTTP/2 SETTINGS frame) is an unreachable agent: the
// plugin's fallback then decides, as when no agent runs.
func TestAnAgentOfAnotherFormatIsUnreachable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cni.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00"))
			_ = c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := client(t, path).PodAdd(ctx, addReq()); !errors.Is(err, ErrAgentUnreachable) || !strings.Contains(err.Error(), path) {
		t.Errorf("PodAdd to an agent of another format: %v; want ErrAgentUnreachable naming %s", err, path)
	}
	if err := Probe(ctx, path); !errors.Is(err, ErrAgentUnreachable) {
		t.Errorf("Probe of an agent of another format: %v", err)
	}
}

// ctxHandler reports the context of each ADD on calls, then waits for it to end.
type ctxHandler struct {
	fakeHandler
	calls chan context.Context
}

func (h *ctxHandler) PodAdd(ctx context.Context, _ *cniv1.PodAddRequest) (AddResult, error) {
	h.calls <- ctx
	<-ctx.Done()
	return AddResult{}, ctx.Err()
}

// The plugin's deadline travels with the request, and a plugin that hangs
// up cancels its call, as gRPC did.
func TestTheCallEndsWithThePlugin(t *testing.T) {
	h := &ctxHandler{calls: make(chan context.Context, 1)}
	c := client(t, start(t, h))

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	errc := make(chan error, 1)
	go func() { _, err := c.PodAdd(ctx, addReq()); errc <- err }()
	call := <-h.calls
	if dl, ok := call.Deadline(); !ok || time.Until(dl) > 3*time.Second || time.Until(dl) < time.Second {
		t.Errorf("the handler's deadline is %v away (set: %v); want the plugin's 3s", time.Until(dl), ok)
	}
	cancel() // the plugin gives up and hangs up
	select {
	case <-call.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("the call goes on after the plugin hung up")
	}
	if err := <-errc; !errors.Is(err, ErrAgentUnreachable) {
		t.Errorf("PodAdd cancelled: %v", err)
	}

	// A deadline too far to be a time.Duration is capped, not wrapped
	// into the past.
	conn, err := net.Dial("unix", c.path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if err := cniv1.WriteFrame(conn, cniv1.KindAdd, &cniv1.Request{TimeoutMillis: math.MaxInt64, Pod: addReq().Pod, Ips: addReq().Ips}); err != nil {
		t.Fatal(err)
	}
	call = <-h.calls
	if dl, ok := call.Deadline(); !ok || time.Until(dl) < 59*time.Minute || call.Err() != nil {
		t.Errorf("a request asking for the longest deadline got one %v away (set: %v, err %v)", time.Until(dl), ok, call.Err())
	}
}

// socketpair returns the two ends of a connected unix stream socket.
func socketpair(t testing.TB) (agent, plugin *net.UnixConn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("socketpair: %v", err)
	}
	var ends [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		_ = f.Close()
		if err != nil {
			t.Fatalf("socketpair: %v", err)
		}
		ends[i] = c.(*net.UnixConn)
	}
	return ends[0], ends[1]
}

// Whatever arrives on a connection, the server answers with one frame the
// plugin reads (nothing only when nothing arrived), never panics, and the
// handler sees only requests whose every identity passes pkg/validate.
func FuzzServeConn(f *testing.F) {
	good, err := cniv1.AppendFrame(nil, cniv1.KindAdd, &cniv1.Request{Pod: addReq().Pod, Ips: addReq().Ips, TimeoutMillis: 1000})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(good[:cniv1.HeaderLen+4])
	f.Add(rawFrame(1, cniv1.KindDel, `{"pod":{"containerId":"c1"}}`))
	f.Add(rawFrame(1, cniv1.KindDel, `{"pod":{"name":"../x","namespace":"a"}}`))
	f.Add(rawFrame(1, cniv1.KindProbe, `{}`))
	f.Add(rawFrame(2, cniv1.KindProbe, `{}`))
	f.Add([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	f.Add(binary.BigEndian.AppendUint32([]byte("AECN\x01A"), 1<<31))
	f.Add([]byte("AE"))
	f.Fuzz(func(t *testing.T, data []byte) {
		h := &fakeHandler{}
		srv := quietServer(h)
		agent, plugin := socketpair(t)
		defer plugin.Close()
		done := make(chan struct{})
		go func() { defer close(done); srv.serveConn(context.Background(), agent) }()
		go func() {
			_, _ = plugin.Write(data)
			_ = plugin.CloseWrite()
		}()
		_ = plugin.SetReadDeadline(time.Now().Add(5 * time.Second))
		answer, err := cniv1.ReadFrame(plugin)
		<-done
		switch {
		case len(data) == 0:
			if !errors.Is(err, io.EOF) {
				t.Fatalf("answered %v, %v to nothing", answer, err)
			}
		case err != nil:
			t.Fatalf("no answer to %q: %v", data, err)
		case answer.Version != cniv1.Version || (answer.Kind != cniv1.KindResult && answer.Kind != cniv1.KindError):
			t.Fatalf("answered a %s frame of version %d", answer.Kind, answer.Version)
		}
		for _, r := range h.adds {
			if validAdd(r) != nil {
				t.Fatalf("the handler got add %v", r)
			}
		}
		for _, r := range h.dels {
			if validPod(r.GetPod(), false) != nil {
				t.Fatalf("the handler got del %v", r)
			}
		}
	})
}
