package snapshot

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/zstd"
)

// A sealed file is a snapshot file as it leaves the node for a registry: compressed (zstd: a
// sparse disk's holes and a guest's free memory cost nothing), then encrypted and authenticated
// with the snapshot's own key (AES-256-GCM) in chunks, so that the registry sees sizes and
// nothing of the tenant's memory or disk, and a registry (or anyone on the way) that changes,
// reorders, drops or appends a byte makes the open fail:
//
//	"IMPSEAL1" | nonce prefix (8 bytes) | chunk... where chunk = length (4 bytes, big endian) | ciphertext
//
// Chunk i is sealed with nonce prefix|i and additional data name|i|final, where final is 1 on
// the last chunk only (which may be empty): a file cut short at a chunk boundary has no final
// chunk and fails too.
const (
	sealMagic = "IMPSEAL1"
	sealChunk = 1 << 20
)

// KeySize is the size of a snapshot's key.
const KeySize = 32

// NewKey returns a fresh snapshot key.
func NewKey() ([]byte, error) {
	k := make([]byte, KeySize)
	_, err := rand.Read(k)
	return k, err
}

// Seal writes src, compressed and sealed with key for name, to dst.
func Seal(dst io.Writer, src io.Reader, key []byte, name string) error {
	aead, err := newAEAD(key)
	if err != nil {
		return err
	}
	prefix := make([]byte, 8)
	if _, err := rand.Read(prefix); err != nil {
		return err
	}
	if _, err := dst.Write(append([]byte(sealMagic), prefix...)); err != nil {
		return err
	}
	sw := &sealWriter{dst: dst, aead: aead, prefix: prefix, name: name, buf: make([]byte, 0, sealChunk)}
	zw, err := zstd.NewWriter(sw, zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithEncoderConcurrency(1))
	if err != nil {
		return err
	}
	if _, err := io.Copy(zw, src); err != nil {
		zw.Close()
		return err
	}
	if err := zw.Close(); err != nil {
		return err
	}
	return sw.finish()
}

type sealWriter struct {
	dst    io.Writer
	aead   cipher.AEAD
	prefix []byte
	name   string
	buf    []byte
	n      uint32
}

func (w *sealWriter) Write(p []byte) (int, error) {
	total := len(p)
	for len(p) > 0 {
		room := sealChunk - len(w.buf)
		take := min(room, len(p))
		w.buf = append(w.buf, p[:take]...)
		p = p[take:]
		if len(w.buf) == sealChunk {
			if err := w.chunk(false); err != nil {
				return 0, err
			}
		}
	}
	return total, nil
}

func (w *sealWriter) chunk(final bool) error {
	ct := w.aead.Seal(nil, nonce(w.prefix, w.n), w.buf, aad(w.name, w.n, final))
	var l [4]byte
	binary.BigEndian.PutUint32(l[:], uint32(len(ct)))
	if _, err := w.dst.Write(append(l[:], ct...)); err != nil {
		return err
	}
	w.n++
	w.buf = w.buf[:0]
	return nil
}

func (w *sealWriter) finish() error { return w.chunk(true) }

// Open writes the file sealed in src for name with key to dst, at most max bytes of it.
func Open(dst io.Writer, src io.Reader, key []byte, name string, max int64) error {
	aead, err := newAEAD(key)
	if err != nil {
		return err
	}
	hdr := make([]byte, len(sealMagic)+8)
	if _, err := io.ReadFull(src, hdr); err != nil {
		return fmt.Errorf("reading the sealed %s: %w", name, err)
	}
	if string(hdr[:len(sealMagic)]) != sealMagic {
		return fmt.Errorf("the sealed %s is not a sealed snapshot file", name)
	}
	or := &openReader{src: src, aead: aead, prefix: hdr[len(sealMagic):], name: name}
	zr, err := zstd.NewReader(or, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(64<<20))
	if err != nil {
		return err
	}
	defer zr.Close()
	n, err := io.Copy(dst, io.LimitReader(zr, max+1))
	if err != nil {
		return fmt.Errorf("opening the sealed %s: %w", name, err)
	}
	if n > max {
		return fmt.Errorf("the sealed %s holds more than %d bytes", name, max)
	}
	// Whatever zstd left unread must still authenticate to its final chunk.
	if _, err := io.Copy(io.Discard, or); err != nil {
		return fmt.Errorf("opening the sealed %s: %w", name, err)
	}
	if !or.final {
		return fmt.Errorf("the sealed %s is cut short", name)
	}
	return nil
}

type openReader struct {
	src    io.Reader
	aead   cipher.AEAD
	prefix []byte
	name   string
	n      uint32
	plain  []byte
	final  bool
}

func (r *openReader) Read(p []byte) (int, error) {
	for len(r.plain) == 0 {
		if r.final {
			return 0, io.EOF
		}
		var l [4]byte
		if _, err := io.ReadFull(r.src, l[:]); err != nil {
			return 0, fmt.Errorf("cut short before chunk %d: %w", r.n, err)
		}
		size := binary.BigEndian.Uint32(l[:])
		if size > sealChunk+uint32(r.aead.Overhead()) {
			return 0, fmt.Errorf("chunk %d claims %d bytes", r.n, size)
		}
		ct := make([]byte, size)
		if _, err := io.ReadFull(r.src, ct); err != nil {
			return 0, fmt.Errorf("cut short in chunk %d: %w", r.n, err)
		}
		var err error
		for _, final := range []bool{false, true} {
			if r.plain, err = r.aead.Open(nil, nonce(r.prefix, r.n), ct, aad(r.name, r.n, final)); err == nil {
				r.final = final
				break
			}
		}
		if err != nil {
			return 0, errors.New("a chunk does not authenticate: the file was changed, or sealed with another key or for another file")
		}
		r.n++
		if r.final {
			// Nothing may follow the final chunk.
			var extra [1]byte
			if n, _ := r.src.Read(extra[:]); n > 0 {
				return 0, errors.New("bytes follow the final chunk")
			}
		}
	}
	n := copy(p, r.plain)
	r.plain = r.plain[n:]
	return n, nil
}

func newAEAD(key []byte) (cipher.AEAD, error) {
	if len(key) != KeySize {
		return nil, fmt.Errorf("a snapshot key has %d bytes, not %d", len(key), KeySize)
	}
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

func nonce(prefix []byte, n uint32) []byte {
	out := make([]byte, 12)
	copy(out, prefix)
	binary.BigEndian.PutUint32(out[8:], n)
	return out
}

func aad(name string, n uint32, final bool) []byte {
	out := append([]byte(name), 0, 0, 0, 0, 0)
	binary.BigEndian.PutUint32(out[len(name):], n)
	if final {
		out[len(out)-1] = 1
	}
	return out
}
