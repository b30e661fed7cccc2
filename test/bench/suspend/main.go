// Command suspend benchmarks suspending and resuming a 256 MiB guest under QEMU (TCG here):
// time from the suspend request until the VMM is gone with the state saved, and from the
// resume until the guest runs again, over several rounds of one running guest.
//
//	go run ./test/bench/suspend -rounds 5      (make bench-suspend)
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/test/bench/benchguest"
)

func main() {
	rounds := flag.Int("rounds", 5, "suspend/resume rounds")
	mem := flag.Int64("memory", 256, "guest memory, MiB")
	flag.Parse()
	benchguest.RunOnce(func(b *testing.B) error { return run(b, *rounds, *mem) })
}

func run(b *testing.B, rounds int, mem int64) error {
	host, err := benchguest.NewHost(b)
	if err != nil {
		return err
	}
	spec, rec, err := host.Boot("vm", mem)
	if err != nil {
		return err
	}
	dir := spec.Dir
	defer func() { _ = qemu.Quit(dir) }()
	ticks := func() int { return benchguest.Ticks(dir) }
	var sus, res []time.Duration
	var stateBytes int64
	for i := 0; i < rounds; i++ {
		t0 := time.Now()
		if err := qemu.Suspend(dir, time.Minute); err != nil {
			return err
		}
		for rec.Alive() {
			time.Sleep(5 * time.Millisecond)
		}
		sus = append(sus, time.Since(t0))
		if fi, err := os.Stat(filepath.Join(dir, qemu.StateFile)); err == nil {
			stateBytes = fi.Size()
		}
		spec.Incoming = filepath.Join(dir, qemu.StateFile)
		t0 = time.Now()
		if rec, err = qemu.Start(spec, "bench"); err != nil {
			return err
		}
		if err := qemu.ResumeIncoming(dir, rec, time.Minute); err != nil {
			return err
		}
		res = append(res, time.Since(t0))
		n := ticks()
		for deadline := time.Now().Add(30 * time.Second); ticks() <= n; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				return fmt.Errorf("the guest did not continue after resume %d", i)
			}
		}
	}
	p50 := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2].Round(time.Millisecond)
	}
	fmt.Printf("suspend/resume of a %d MiB guest (%s, %d rounds, state file %d MiB):\n", mem, spec.Accel, rounds, stateBytes>>20)
	fmt.Printf("  suspend (save state, VMM gone): P50 %v  all %v\n", p50(sus), sus)
	fmt.Printf("  resume (VMM up, state loaded, guest running): P50 %v  all %v\n", p50(res), res)
	return nil
}
