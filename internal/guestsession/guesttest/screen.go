package guesttest

import (
	"bytes"
	"regexp"
	"sync"
	"testing"
	"time"
)

// Screen is what a stream or a terminal wrote, read by the test while it is written.
type Screen struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Screen) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *Screen) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// WaitFor waits up to timeout for the screen to hold want.
func (s *Screen) WaitFor(t testing.TB, want string, timeout time.Duration) {
	t.Helper()
	s.WaitForMatch(t, regexp.MustCompile(regexp.QuoteMeta(want)), timeout)
}

// WaitForMatch waits up to timeout for the screen to match re.
func (s *Screen) WaitForMatch(t testing.TB, re *regexp.Regexp, timeout time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(timeout); !re.MatchString(s.String()); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %q; got %q", timeout, re, s.String())
		}
	}
}
