// Package streamcap bounds the streams open at once per key (a user, a VM): each costs the
// server a goroutine, a descriptor and a connection for as long as its client keeps it, and a
// client with read access alone may open them by the thousand.
package streamcap

import (
	"fmt"
	"sync"
)

// Limiter counts the streams open per key. The zero value allows none; New sets the bound.
type Limiter struct {
	max  int
	what string // what a key is, for the refusal ("user", "VM")

	mu   sync.Mutex
	open map[string]int
}

// New returns a limiter of max streams per key, a key being what (for the error).
func New(max int, what string) *Limiter {
	return &Limiter{max: max, what: what, open: map[string]int{}}
}

// Full is the refusal of a stream past the bound.
type Full struct {
	What, Key string
	Max       int
}

func (e *Full) Error() string {
	return fmt.Sprintf("%s %s has %d streams open, the most there may be: close one first", e.What, e.Key, e.Max)
}

// Acquire counts a stream of key, or refuses it with *Full; release (once; later calls do
// nothing) ends it.
func (l *Limiter) Acquire(key string) (release func(), err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[key] >= l.max {
		return nil, &Full{What: l.what, Key: key, Max: l.max}
	}
	l.open[key]++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			if l.open[key]--; l.open[key] <= 0 {
				delete(l.open, key)
			}
		})
	}, nil
}

// Open is the number of streams of key open now.
func (l *Limiter) Open(key string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open[key]
}
