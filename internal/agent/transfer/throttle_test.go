package transfer

import (
	"bytes"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// TestThrottledStreamsShareTheBound: two streams sharing a bound of 4 MiB/s send 4 MiB in all
// in no less than the bound allows (a second, less the burst), and every byte arrives; with
// no bound the same bytes go through unthrottled.
func TestThrottledStreamsShareTheBound(t *testing.T) {
	const rate, total = 4 << 20, 4 << 20
	run := func(bound int64) time.Duration {
		lim := NewLimit(bound)
		var wg sync.WaitGroup
		began := time.Now()
		for i := 0; i < 2; i++ {
			a, b := net.Pipe()
			payload := bytes.Repeat([]byte{byte(i + 1)}, total/2)
			wg.Add(2)
			go func() {
				defer wg.Done()
				w := Throttled(a, lim)
				if _, err := w.Write(payload); err != nil {
					t.Error(err)
				}
				w.Close()
			}()
			go func() {
				defer wg.Done()
				got, err := io.ReadAll(b)
				if err != nil || !bytes.Equal(got, payload) {
					t.Errorf("stream %d: %d bytes arrived (%v); want its %d", i, len(got), err, len(payload))
				}
			}()
		}
		wg.Wait()
		return time.Since(began)
	}
	if took, floor := run(rate), time.Duration(float64(total-throttleBurst)/rate*float64(time.Second)); took < floor {
		t.Errorf("4 MiB went out in %v under a bound of 4 MiB/s; the bound allows no less than %v", took, floor)
	}
	if NewLimit(0) != nil || Throttled(nil, nil) != nil {
		t.Error("no bound is not unbounded")
	}
	run(0)
}
