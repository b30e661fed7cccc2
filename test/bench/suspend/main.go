// Command suspend benchmarks suspending and resuming a 256 MiB guest under QEMU (TCG here):
// time from the suspend request until the VMM is gone with the state saved, and from the
// resume until the guest runs again, over several rounds of one running guest.
//
//	go run ./test/bench/suspend -rounds 5      (make bench-suspend)
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

func main() {
	rounds := flag.Int("rounds", 5, "suspend/resume rounds")
	mem := flag.Int64("memory", 256, "guest memory, MiB")
	flag.Parse()
	// testguest and testregistry take a testing.TB: run the benchmark inside one, once.
	ran := false
	res := testing.Benchmark(func(b *testing.B) {
		if ran {
			return
		}
		ran = true
		if err := run(b, *rounds, *mem); err != nil {
			b.Fatal(err)
		}
	})
	if res.N == 0 {
		os.Exit(1)
	}
}

func run(b *testing.B, rounds int, mem int64) error {
	b.StopTimer()
	tmp := b.TempDir()
	kernel, initrd := testguest.Artifacts(b, tmp)
	host := testregistry.Start(b, "", "")
	ref := testguest.Image(b, host, "hello")
	base, _, err := (&disk.BaseStore{Dir: filepath.Join(tmp, "images"), MaxBytes: 1 << 30}).Ensure(context.Background(), ref, disk.PullSecretKeychain{})
	if err != nil {
		return err
	}
	dir := filepath.Join(tmp, "vm")
	_ = os.Mkdir(dir, 0o700)
	rw := filepath.Join(dir, "rw.ext4")
	if err := disk.EnsureWritable(rw, 64<<20, ""); err != nil {
		return err
	}
	config := filepath.Join(dir, "config.img")
	if err := disk.WriteConfig(config, guestinit.Config{Argv: []string{"/bin/hello", "serve"}, Hostname: "bench"}); err != nil {
		return err
	}
	spec := qemu.Spec{Dir: dir, Kernel: kernel, Initramfs: initrd, BaseDisk: base, WritableDisk: rw, ConfigDisk: config, VCPUs: 1, MemoryMiB: mem,
		Token: "t", Accel: qemu.Accel(), TSCkHz: qemu.TSCkHz()}
	rec, err := qemu.Start(spec, "bench")
	if err != nil {
		return err
	}
	defer func() { _ = qemu.Quit(dir) }()
	go func() { // the agent's end of the guest channel
		for {
			if c, err := qemu.DialChannel(dir); err == nil {
				_, _ = io.Copy(io.Discard, c)
				c.Close()
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	ticks := func() int {
		s, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
		return strings.Count(string(s), "hello: tick ")
	}
	for deadline := time.Now().Add(3 * time.Minute); ticks() < 2; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("the guest did not boot")
		}
	}
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
		if err := qemu.ResumeIncoming(dir, time.Minute); err != nil {
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
