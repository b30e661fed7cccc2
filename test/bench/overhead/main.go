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
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/test/bench/benchguest"
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
	benchguest.RunOnce(func(b *testing.B) error { return run(b, mibs, *settle) })
}

func run(b *testing.B, sizes []int64, settle time.Duration) error {
	host, err := benchguest.NewHost(b)
	if err != nil {
		return err
	}
	fmt.Printf("QEMU VMM memory beyond guest RAM (%s), after %s of workload:\n", qemu.Accel(), settle)
	fmt.Printf("%10s %12s %14s %12s\n", "guest MiB", "VmRSS MiB", "guest RAM MiB", "overhead MiB")
	for _, mem := range sizes {
		spec, rec, err := host.Boot(fmt.Sprintf("vm-%d", mem), mem)
		if err != nil {
			return err
		}
		time.Sleep(settle)
		total, guest, err := resident(rec, mem<<20)
		_ = qemu.Quit(spec.Dir)
		if err != nil {
			return err
		}
		fmt.Printf("%10d %12.1f %14.1f %12.1f\n", mem, mib(total), mib(guest), mib(total-guest))
	}
	return nil
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

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
