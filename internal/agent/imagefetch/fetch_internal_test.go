package imagefetch

import (
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// A start takes its fetch once done; it waits for it only as long as it is told to (the pass
// that begins a fetch waits up to FetchWait, later passes not at all).
func TestTakeFetch(t *testing.T) {
	for _, tc := range []struct {
		name    string
		doneIn  time.Duration // <0: never
		wait    time.Duration
		want    bool
		atLeast time.Duration
		atMost  time.Duration
	}{
		{name: "done before", doneIn: 0, wait: 0, want: true, atMost: 10 * time.Millisecond},
		{name: "running, no wait", doneIn: -1, wait: 0, want: false, atMost: 10 * time.Millisecond},
		{name: "done within the wait", doneIn: 20 * time.Millisecond, wait: time.Second, want: true, atLeast: 20 * time.Millisecond, atMost: 500 * time.Millisecond},
		{name: "not done within the wait", doneIn: -1, wait: 50 * time.Millisecond, want: false, atLeast: 50 * time.Millisecond, atMost: time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := &Fetches{byVM: map[types.UID]*fetch{}}
			f := &fetch{done: make(chan struct{})}
			fs.byVM["vm"] = f
			switch {
			case tc.doneIn == 0:
				close(f.done)
			case tc.doneIn > 0:
				time.AfterFunc(tc.doneIn, func() { close(f.done) })
			}
			began := time.Now()
			got := fs.take("vm", f, tc.wait)
			took := time.Since(began)
			if (got != nil) != tc.want {
				t.Fatalf("took the fetch: %v, want %v", got != nil, tc.want)
			}
			if took < tc.atLeast || took > tc.atMost {
				t.Errorf("returned after %v, want within [%v, %v]", took, tc.atLeast, tc.atMost)
			}
			if _, kept := fs.byVM["vm"]; kept == tc.want {
				t.Errorf("the fetch is still recorded: %v, want %v", kept, !tc.want)
			}
		})
	}
}
