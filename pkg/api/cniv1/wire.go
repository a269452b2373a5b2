// Copyright ambient-ebpf authors
// SPDX-License-Identifier: Apache-2.0

package cniv1

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The frame: Magic, the version, the kind, the body's length (big endian)
// and the body, JSON. One request and one answer per connection.
const (
	Magic     = "AECN"
	Version   = 1
	HeaderLen = len(Magic) + 1 + 1 + 4
	// MaxBody bounds a frame's body; a longer one is refused before it
	// is read. A request is a pod's identities and addresses, well under
	// 8 KiB.
	MaxBody = 64 << 10
)

// Kind is what a frame carries: a request (add, del, probe) or an answer
// (result, error).
type Kind byte

const (
	KindAdd    Kind = 'A'
	KindDel    Kind = 'D'
	KindProbe  Kind = 'P'
	KindResult Kind = 'R'
	KindError  Kind = 'E'
)

func (k Kind) String() string {
	switch k {
	case KindAdd:
		return "add"
	case KindDel:
		return "del"
	case KindProbe:
		return "probe"
	case KindResult:
		return "result"
	case KindError:
		return "error"
	}
	return fmt.Sprintf("kind 0x%02x", byte(k))
}

// Request is the body of an add, del or probe frame: add carries Pod and
// Ips, del Pod, probe nothing. TimeoutMillis is what is left of the
// plugin's deadline when it sends; the agent's handler gets that deadline
// (0: none).
type Request struct {
	TimeoutMillis int64    `json:"timeoutMillis,omitempty"`
	Pod           *Pod     `json:"pod,omitempty"`
	Ips           []string `json:"ips,omitempty"`
}

// Code says which answer the agent gave; the plugin tells the fail-closed
// cases apart by it.
type Code string

const (
	// CodeOK is a result frame's code, for observers.
	CodeOK Code = "ok"
	// CodeInvalidArgument: the request was malformed or named an invalid
	// identity; nothing was done.
	CodeInvalidArgument Code = "invalid-argument"
	// CodeUnsupportedVersion: the frame's version is not the agent's.
	CodeUnsupportedVersion Code = "unsupported-version"
	// CodeNoZtunnel: enrollment failed because no ztunnel is connected.
	CodeNoZtunnel Code = "no-ztunnel"
	// CodeDeadlineExceeded: the plugin's deadline passed while the agent
	// worked.
	CodeDeadlineExceeded Code = "deadline-exceeded"
	// CodeCanceled: the call was cancelled (the plugin hung up, the agent
	// stopped).
	CodeCanceled Code = "canceled"
	// CodeUnavailable: the agent is stopping and serves no more calls.
	CodeUnavailable Code = "unavailable"
	// CodeInternal: the agent could not enroll the pod.
	CodeInternal Code = "internal"
)

// Error is the body of an error frame, the same in every version so that
// either side can say why it refuses the other's.
type Error struct {
	Code    Code   `json:"code"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return e.Message }

// Errors of the codec.
var (
	// ErrMalformed: a frame or its body does not follow this format.
	ErrMalformed = errors.New("malformed cni frame")
	// ErrVersion: a frame of another version than Version.
	ErrVersion = errors.New("unsupported cni wire version")
)

// Frame is a frame as read, its body not yet decoded.
type Frame struct {
	Version uint8
	Kind    Kind
	Body    []byte
}

// ReadFrame reads one frame from r. It refuses, wrapping ErrMalformed, a
// frame that does not start with Magic, declares a body longer than MaxBody
// (before reading it) or ends early; io.EOF means r ended before the frame
// began. It does not check the version or the kind.
func ReadFrame(r io.Reader) (Frame, error) {
	var h [HeaderLen]byte
	if n, err := io.ReadFull(r, h[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return Frame{}, fmt.Errorf("%w: header cut short after %d of %d bytes", ErrMalformed, n, HeaderLen)
		}
		return Frame{}, err
	}
	if !bytes.Equal(h[:len(Magic)], []byte(Magic)) {
		return Frame{}, fmt.Errorf("%w: it starts with %q, not %q", ErrMalformed, h[:len(Magic)], Magic)
	}
	f := Frame{Version: h[4], Kind: Kind(h[5])}
	size := binary.BigEndian.Uint32(h[6:])
	if size > MaxBody {
		return Frame{}, fmt.Errorf("%w: %s body of %d bytes, more than the %d allowed", ErrMalformed, f.Kind, size, MaxBody)
	}
	f.Body = make([]byte, size)
	if n, err := io.ReadFull(r, f.Body); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return Frame{}, fmt.Errorf("%w: %s body cut short after %d of %d bytes", ErrMalformed, f.Kind, n, size)
		}
		return Frame{}, err
	}
	return f, nil
}

// AppendFrame appends a frame of kind with v, JSON, as its body.
func AppendFrame(dst []byte, kind Kind, v any) ([]byte, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return dst, fmt.Errorf("encode %s frame: %w", kind, err)
	}
	if len(body) > MaxBody {
		return dst, fmt.Errorf("encode %s frame: body of %d bytes, more than the %d allowed", kind, len(body), MaxBody)
	}
	dst = append(dst, Magic...)
	dst = append(dst, Version, byte(kind))
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(body)))
	return append(dst, body...), nil
}

// WriteFrame writes a frame of kind with v as its body in one write.
func WriteFrame(w io.Writer, kind Kind, v any) error {
	b, err := AppendFrame(nil, kind, v)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// Decode decodes a body into v strictly: one JSON value, no field v does
// not have, nothing after it. Errors wrap ErrMalformed.
func Decode(body []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: empty body", ErrMalformed)
	} else if err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: data after the body's JSON value", ErrMalformed)
	}
	return nil
}

// ReadRequest reads the request frame the agent serves: its kind and its
// body, checked. Errors wrap ErrVersion for a frame of another version and
// ErrMalformed for anything else this format refuses; kind is returned
// with the error when the header was read, so the refusal can be counted
// against it.
func ReadRequest(r io.Reader) (Kind, *Request, error) {
	f, err := ReadFrame(r)
	if err != nil {
		return 0, nil, err
	}
	if f.Version != Version {
		return f.Kind, nil, fmt.Errorf("%w: version %d, this end speaks %d", ErrVersion, f.Version, Version)
	}
	if f.Kind != KindAdd && f.Kind != KindDel && f.Kind != KindProbe {
		return f.Kind, nil, fmt.Errorf("%w: %s is not a request", ErrMalformed, f.Kind)
	}
	var req Request
	if err := Decode(f.Body, &req); err != nil {
		return f.Kind, nil, fmt.Errorf("%s request: %w", f.Kind, err)
	}
	switch {
	case req.TimeoutMillis < 0:
		return f.Kind, nil, fmt.Errorf("%w: %s request with a negative timeout", ErrMalformed, f.Kind)
	case f.Kind != KindAdd && len(req.Ips) > 0:
		return f.Kind, nil, fmt.Errorf("%w: %s request with addresses", ErrMalformed, f.Kind)
	case f.Kind == KindProbe && req.Pod != nil:
		return f.Kind, nil, fmt.Errorf("%w: probe request with a pod", ErrMalformed)
	}
	return f.Kind, &req, nil
}

// ReadAnswer reads the agent's answer to a request: a result, its body
// decoded into v (nil: an empty body expected), or an error frame, returned
// as *Error whatever its version.
func ReadAnswer(r io.Reader, v any) error {
	f, err := ReadFrame(r)
	if err != nil {
		return err
	}
	if f.Kind == KindError {
		var e Error
		if err := json.Unmarshal(f.Body, &e); err != nil || e.Code == "" {
			return fmt.Errorf("%w: error frame without a code: %q", ErrMalformed, f.Body)
		}
		return &e
	}
	if f.Version != Version {
		return fmt.Errorf("%w: version %d, this end speaks %d", ErrVersion, f.Version, Version)
	}
	if f.Kind != KindResult {
		return fmt.Errorf("%w: %s is not an answer", ErrMalformed, f.Kind)
	}
	if v == nil {
		v = &struct{}{}
	}
	return Decode(f.Body, v)
}
