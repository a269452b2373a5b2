// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cniv1

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

func addRequest() *Request {
	return &Request{TimeoutMillis: 5000,
		Pod: &Pod{Name: "web", Namespace: "demo", Uid: "u-1", ContainerId: "c1", Netns: "/var/run/netns/x", Interface: "eth0"},
		Ips: []string{"198.18.0.5", "fd00:198:18::5"}}
}

// frame is a hand-made frame: header fields and body as given.
func frame(version byte, kind Kind, body string) []byte {
	b := append([]byte(Magic), version, byte(kind))
	b = binary.BigEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

func TestRequestRoundTrip(t *testing.T) {
	for _, kind := range []Kind{KindAdd, KindDel, KindProbe} {
		req := addRequest()
		switch kind {
		case KindDel:
			req.Ips = nil
		case KindProbe:
			req.Pod, req.Ips = nil, nil
		}
		var buf bytes.Buffer
		if err := WriteFrame(&buf, kind, req); err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(buf.Bytes(), []byte{'A', 'E', 'C', 'N', Version, byte(kind)}) {
			t.Errorf("%s frame starts % x", kind, buf.Bytes()[:HeaderLen])
		}
		gotKind, got, err := ReadRequest(&buf)
		if err != nil || gotKind != kind || got.TimeoutMillis != req.TimeoutMillis ||
			got.Pod.String() != req.Pod.String() || !slices.Equal(got.Ips, req.Ips) {
			t.Errorf("%s read back as %s %+v, %v; want %+v", kind, gotKind, got, err, req)
		}
		if buf.Len() != 0 {
			t.Errorf("%s: %d bytes left after the frame", kind, buf.Len())
		}
	}
}

func TestAnswerRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteFrame(&buf, KindResult, &PodAddResponse{Enrolled: true, Reason: "pod labelled ambient"}); err != nil {
		t.Fatal(err)
	}
	var resp PodAddResponse
	if err := ReadAnswer(&buf, &resp); err != nil || !resp.Enrolled || resp.Reason != "pod labelled ambient" {
		t.Errorf("result read back as %+v, %v", resp, err)
	}
	if err := WriteFrame(&buf, KindResult, struct{}{}); err != nil {
		t.Fatal(err)
	}
	if err := ReadAnswer(&buf, nil); err != nil {
		t.Errorf("empty result: %v", err)
	}
	// An error frame reads the same whatever its version.
	for _, v := range []byte{Version, Version + 1} {
		err := ReadAnswer(bytes.NewReader(frame(v, KindError, `{"code":"no-ztunnel","message":"pod demo/web: no ztunnel connected"}`)), nil)
		if e, ok := errors.AsType[*Error](err); !ok || e.Code != CodeNoZtunnel || e.Error() != "pod demo/web: no ztunnel connected" {
			t.Errorf("error frame of version %d read as %v", v, err)
		}
	}
	if err := ReadAnswer(bytes.NewReader(frame(Version+1, KindResult, `{}`)), nil); !errors.Is(err, ErrVersion) {
		t.Errorf("result of another version: %v", err)
	}
	if err := ReadAnswer(bytes.NewReader(frame(Version, KindError, `{}`)), nil); !errors.Is(err, ErrMalformed) {
		t.Errorf("error frame without a code: %v", err)
	}
}

// Every frame this format does not allow is refused with an error saying
// why; an oversized one before its body is read.
func TestMalformedRequestsAreRefused(t *testing.T) {
	oversized := binary.BigEndian.AppendUint32(append([]byte(Magic), Version, byte(KindAdd)), MaxBody+1)
	cases := []struct {
		name string
		data []byte
		want error
		says string
	}{
		{"empty", nil, io.EOF, ""},
		{"cut header", []byte("AEC"), ErrMalformed, "header cut short"},
		{"http/2 preface", []byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), ErrMalformed, `starts with "PRI "`},
		{"oversized", oversized, ErrMalformed, "more than the 65536 allowed"},
		{"cut body", frame(Version, KindAdd, `{"pod":{}}`)[:HeaderLen+3], ErrMalformed, "body cut short after 3 of 10 bytes"},
		{"other version", frame(Version+1, KindAdd, `{}`), ErrVersion, "version 2"},
		{"answer kind", frame(Version, KindResult, `{}`), ErrMalformed, "result is not a request"},
		{"unknown kind", frame(Version, 'x', `{}`), ErrMalformed, "kind 0x78"},
		{"empty body", frame(Version, KindAdd, ``), ErrMalformed, "add request: malformed cni frame: empty body"},
		{"not json", frame(Version, KindAdd, `pod`), ErrMalformed, "add request"},
		{"not an object", frame(Version, KindAdd, `[1]`), ErrMalformed, "add request"},
		{"unknown field", frame(Version, KindAdd, `{"pod":{"name":"web","nodeName":"n"}}`), ErrMalformed, "nodeName"},
		{"trailing data", frame(Version, KindAdd, `{} {}`), ErrMalformed, "after the body"},
		{"negative timeout", frame(Version, KindAdd, `{"timeoutMillis":-1}`), ErrMalformed, "negative timeout"},
		{"del with ips", frame(Version, KindDel, `{"ips":["198.18.0.5"]}`), ErrMalformed, "del request with addresses"},
		{"probe with pod", frame(Version, KindProbe, `{"pod":{}}`), ErrMalformed, "probe request with a pod"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := bytes.NewReader(tc.data)
			if tc.name == "oversized" {
				r = bytes.NewReader(append(tc.data, make([]byte, MaxBody+1)...))
			}
			_, req, err := ReadRequest(r)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) || req != nil {
				t.Errorf("ReadRequest = %+v, %v; want %v saying %q", req, err, tc.want, tc.says)
			}
			if tc.name == "oversized" && r.Len() != MaxBody+1 {
				t.Errorf("an oversized frame's body was read (%d bytes left of %d)", r.Len(), MaxBody+1)
			}
		})
	}
	if _, err := AppendFrame(nil, KindAdd, &Request{Ips: []string{strings.Repeat("1", MaxBody)}}); err == nil {
		t.Error("AppendFrame wrote a body longer than MaxBody")
	}
}

// countingReader counts what was read from r.
type countingReader struct {
	r io.Reader
	n int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += n
	return n, err
}

// Whatever arrives, ReadRequest never panics, reads no more than one
// frame's bound, refuses with ErrMalformed or ErrVersion (or io.EOF for
// nothing at all), and what it accepts encodes back to a frame that reads
// the same.
func FuzzReadRequest(f *testing.F) {
	for _, kind := range []Kind{KindAdd, KindDel, KindProbe} {
		b, err := AppendFrame(nil, kind, addRequest())
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add(frame(Version, KindProbe, `{}`))
	f.Add(frame(Version, KindDel, `{"pod":{"containerId":"c1"}}`))
	f.Add(frame(Version, KindAdd, `{"pod":{"name":"web\u0000"},"ips":[""],"timeoutMillis":9223372036854775807}`))
	f.Add(frame(Version+1, KindAdd, `{}`))
	f.Add([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	f.Add(binary.BigEndian.AppendUint32([]byte("AECN\x01A"), 1<<31))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &countingReader{r: bytes.NewReader(data)}
		kind, req, err := ReadRequest(r)
		if r.n > HeaderLen+MaxBody {
			t.Fatalf("read %d bytes, more than a frame may hold", r.n)
		}
		if err != nil {
			if req != nil || !(errors.Is(err, ErrMalformed) || errors.Is(err, ErrVersion) || err == io.EOF) {
				t.Fatalf("ReadRequest = %+v, %v", req, err)
			}
			return
		}
		if kind != KindAdd && kind != KindDel && kind != KindProbe {
			t.Fatalf("accepted a %s frame", kind)
		}
		b, err := AppendFrame(nil, kind, req)
		if err != nil {
			t.Fatalf("accepted request %+v does not encode: %v", req, err)
		}
		kind2, req2, err := ReadRequest(bytes.NewReader(b))
		if err != nil || kind2 != kind || req2.TimeoutMillis != req.TimeoutMillis ||
			req2.Pod.String() != req.Pod.String() || !slices.Equal(req2.Ips, req.Ips) && len(req.Ips)+len(req2.Ips) > 0 {
			t.Fatalf("%s %+v read back as %s %+v, %v", kind, req, kind2, req2, err)
		}
	})
}
