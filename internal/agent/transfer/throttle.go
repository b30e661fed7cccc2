package transfer

import (
	"context"
	"io"

	"golang.org/x/time/rate"
)

// throttleBurst is the most a throttled stream writes at once.
const throttleBurst = 256 << 10

// NewLimit is the bound on what a node's migration streams send together: bytesPerSecond in
// all, shared by every stream Throttled gives it; nil (unbounded) for 0 or less.
func NewLimit(bytesPerSecond int64) *rate.Limiter {
	if bytesPerSecond <= 0 {
		return nil
	}
	return rate.NewLimiter(rate.Limit(bytesPerSecond), int(min(bytesPerSecond, throttleBurst)))
}

// Throttled is c whose writes go out within l, which other streams may share (NewLimit); c
// itself for a nil l. Reads are not bounded: each side bounds what it sends.
func Throttled(c io.ReadWriteCloser, l *rate.Limiter) io.ReadWriteCloser {
	if l == nil {
		return c
	}
	return throttled{ReadWriteCloser: c, l: l}
}

type throttled struct {
	io.ReadWriteCloser
	l *rate.Limiter
}

func (t throttled) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		k := min(len(p), t.l.Burst())
		if err := t.l.WaitN(context.Background(), k); err != nil {
			return n, err
		}
		m, err := t.ReadWriteCloser.Write(p[:k])
		n += m
		if err != nil {
			return n, err
		}
		p = p[k:]
	}
	return n, nil
}
