// Command overhead measures what a QEMU VMM process holds in memory beyond its guest's RAM,
// per guest size: it boots guests of the test image (TCG here, KVM where it works), waits
// until their workload runs, and reads the VMM's resident memory from /proc: the whole
// process (VmRSS), the guest RAM mapping's resident part, and the rest, which is the per-VM
// overhead IMP's placement counts (internal/agent/vmm.MemoryOverhead).
//
//	go run ./test/bench/overhead -sizes 128,256,512      (make bench-overhead)
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

func main() {
	sizes := flag.String("sizes", "128,256,512", "guest memory sizes, MiB")
	settle := flag.Duration("settle", 5*time.Second, "how long the workload runs before measuring")
	flag.Parse()
	var mibs []int64
	for _, s := range strings.Split(*sizes, ",") {
		n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bad -sizes:", err)
			os.Exit(2)
		}
		mibs = append(mibs, n)
	}
	ran := false
	res := testing.Benchmark(func(b *testing.B) {
		if ran {
			return
		}
		ran = true
		if err := run(b, mibs, *settle); err != nil {
			b.Fatal(err)
		}
	})
	if res.N == 0 {
		os.Exit(1)
	}
}

func run(b *testing.B, sizes []int64, settle time.Duration) error {
	b.StopTimer()
	tmp := b.TempDir()
	kernel, initrd := testguest.Artifacts(b, tmp)
	host := testregistry.Start(b, "", "")
	ref := testguest.Image(b, host, "hello")
	base, _, err := (&disk.BaseStore{Dir: filepath.Join(tmp, "images"), MaxBytes: 1 << 30}).Ensure(context.Background(), ref, disk.PullSecretKeychain{})
	if err != nil {
		return err
	}
	accel := qemu.Accel()
	fmt.Printf("QEMU VMM memory beyond guest RAM (%s), after %s of workload:\n", accel, settle)
	fmt.Printf("%10s %12s %14s %12s\n", "guest MiB", "VmRSS MiB", "guest RAM MiB", "overhead MiB")
	for _, mem := range sizes {
		dir := filepath.Join(tmp, fmt.Sprintf("vm-%d", mem))
		if err := os.Mkdir(dir, 0o700); err != nil {
			return err
		}
		rw, config := filepath.Join(dir, "rw.ext4"), filepath.Join(dir, "config.img")
		if err := disk.EnsureWritable(rw, 64<<20, ""); err != nil {
			return err
		}
		if err := disk.WriteConfig(config, guestinit.Config{Argv: []string{"/bin/hello", "serve"}, Hostname: "bench"}); err != nil {
			return err
		}
		spec := qemu.Spec{Dir: dir, Kernel: kernel, Initramfs: initrd, BaseDisk: base, WritableDisk: rw, ConfigDisk: config,
			VCPUs: 1, MemoryMiB: mem, Token: "t", Accel: accel, TSCkHz: qemu.TSCkHz()}
		rec, err := qemu.Start(spec, "bench")
		if err != nil {
			return err
		}
		go drain(dir)
		ticks := func() int {
			s, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
			return strings.Count(string(s), "hello: tick ")
		}
		for deadline := time.Now().Add(3 * time.Minute); ticks() < 2; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				_ = qemu.Quit(dir)
				return fmt.Errorf("the %d MiB guest did not boot", mem)
			}
		}
		time.Sleep(settle)
		total, guest, err := resident(rec, mem<<20)
		_ = qemu.Quit(dir)
		if err != nil {
			return err
		}
		fmt.Printf("%10d %12.1f %14.1f %12.1f\n", mem, mib(total), mib(guest), mib(total-guest))
	}
	return nil
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// drain is the agent's end of the guest channel.
func drain(dir string) {
	for i := 0; i < 600; i++ {
		if c, err := qemu.DialChannel(dir); err == nil {
			_, _ = io.Copy(io.Discard, c)
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// resident returns the VMM's resident bytes and those of its guest RAM mapping (the anonymous
// mapping of exactly the guest's size).
func resident(rec *vmm.Record, guestBytes int64) (total, guest int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", rec.Pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	var size int64
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			var lo, hi uint64
			if _, err := fmt.Sscanf(fields[0], "%x-%x", &lo, &hi); err == nil {
				size = int64(hi - lo)
			}
			continue
		}
		if len(fields) >= 2 && fields[0] == "Rss:" {
			kb, _ := strconv.ParseInt(fields[1], 10, 64)
			total += kb << 10
			if size == guestBytes {
				guest += kb << 10
			}
		}
	}
	return total, guest, sc.Err()
}
