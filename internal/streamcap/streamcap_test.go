package streamcap

import (
	"errors"
	"testing"
)

// TestLimiter: max streams per key, other keys apart; a release frees one place, once.
func TestLimiter(t *testing.T) {
	l := New(2, "user")
	r1, err := l.Acquire("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := l.Acquire("a"); err != nil {
		t.Fatal(err)
	}
	var full *Full
	if _, err := l.Acquire("a"); !errors.As(err, &full) || full.Key != "a" || full.Max != 2 {
		t.Fatalf("a third stream of a: %v", err)
	}
	if _, err := l.Acquire("b"); err != nil {
		t.Errorf("b is bounded by a's streams: %v", err)
	}
	r1()
	r1() // once
	if got := l.Open("a"); got != 1 {
		t.Errorf("a has %d open after one release (twice), want 1", got)
	}
	if _, err := l.Acquire("a"); err != nil {
		t.Errorf("after a release: %v", err)
	}
}
