package testcluster

import (
	"context"
	"sync"
	"testing"
)

// Starter is what RunManager runs: a controller-runtime manager.
type Starter interface {
	Start(ctx context.Context) error
}

// RunManager starts mgr until the test ends (an error from it fails the test); it returns a
// function that stops it earlier and waits for it.
func RunManager(t testing.TB, mgr Starter) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			t.Errorf("manager: %v", err)
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return stop
}
