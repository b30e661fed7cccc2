// Package guestsession is the guest channel's second port: the agent's requests to run a
// command in the guest (exec) and to reach a TCP port inside it (port-forward). One connection
// (a virtio-serial port under QEMU, a vsock connection under Firecracker) carries HTTP/2 with
// prior knowledge: the agent is the client, imp-init the server. HTTP/2 gives what a hostile
// peer must not be able to take away: many streams on one connection, flow control per stream
// and per connection (so memory is bounded on both ends whatever the other does), bounded
// frames and headers, and the Go standard library's hardening of both ends.
//
// Every request carries the VM's token; imp-init refuses one without it.
//
// An exec is one POST /exec whose request body carries the host's frames (stdin, its end, and
// terminal sizes) and whose response body carries the guest's (stdout, stderr, and at the end
// the exit code or an error). A port-forward is one POST /portforward?port=N whose request and
// response bodies are the two directions of a TCP connection to 127.0.0.1:N in the guest.
package guestsession

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// PortName is the name of the virtio-serial port of the session channel (QEMU).
const PortName = "imp.session"

// VsockPortOffset: under Firecracker the session channel is a vsock port this far above the
// status channel's.
const VsockPortOffset = 1

// TokenHeader carries the VM's token on every request.
const TokenHeader = "Imp-Token"

// Paths and query parameters of the requests.
const (
	ExecPath        = "/exec"
	PortForwardPath = "/portforward"
)

// MaxFrame bounds a frame's payload; a longer one ends the exchange with an error.
const MaxFrame = 32 << 10

// Frame types. From the host: Stdin, StdinEOF, Resize. From the guest: Stdout, Stderr, and
// last Exit or Error.
const (
	Stdin byte = iota + 1
	StdinEOF
	Resize
	Stdout
	Stderr
	Exit
	Error
)

// Size is a terminal's size.
type Size struct{ Width, Height uint16 }

// frameHeader is a frame's type and payload length.
const frameHeader = 5

// WriteFrame writes one frame of typ with payload p (at most MaxFrame bytes).
func WriteFrame(w io.Writer, typ byte, p []byte) error {
	if len(p) > MaxFrame {
		return fmt.Errorf("frame of %d bytes, more than %d", len(p), MaxFrame)
	}
	b := make([]byte, frameHeader+len(p))
	b[0] = typ
	binary.BigEndian.PutUint32(b[1:], uint32(len(p)))
	copy(b[frameHeader:], p)
	_, err := w.Write(b)
	return err
}

// errFrameTooLong is a peer's frame longer than MaxFrame.
var errFrameTooLong = errors.New("a frame longer than the maximum")

// FrameReader reads frames into one buffer of MaxFrame bytes: a frame's payload is valid until
// the next Read.
type FrameReader struct {
	r   *bufio.Reader
	buf []byte
}

// NewFrameReader reads frames from r.
func NewFrameReader(r io.Reader) *FrameReader {
	return &FrameReader{r: bufio.NewReaderSize(r, 4096), buf: make([]byte, MaxFrame)}
}

// Read returns the next frame; io.EOF at a clean end between frames.
func (f *FrameReader) Read() (byte, []byte, error) {
	var h [frameHeader]byte
	if _, err := io.ReadFull(f.r, h[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, nil, fmt.Errorf("a truncated frame header: %w", err)
		}
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if n > MaxFrame {
		return 0, nil, fmt.Errorf("%w (%d bytes)", errFrameTooLong, n)
	}
	p := f.buf[:n]
	if _, err := io.ReadFull(f.r, p); err != nil {
		return 0, nil, fmt.Errorf("a truncated frame: %w", err)
	}
	return h[0], p, nil
}

// encodeSize is a Resize frame's payload.
func encodeSize(s Size) []byte {
	var b [4]byte
	binary.BigEndian.PutUint16(b[:], s.Width)
	binary.BigEndian.PutUint16(b[2:], s.Height)
	return b[:]
}

// decodeSize reads a Resize frame's payload.
func decodeSize(p []byte) (Size, bool) {
	if len(p) != 4 {
		return Size{}, false
	}
	return Size{Width: binary.BigEndian.Uint16(p), Height: binary.BigEndian.Uint16(p[2:])}, true
}
