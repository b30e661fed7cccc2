// Package benchguest is what IMP's guest benchmarks share: running a benchmark once inside
// testing.Benchmark (the test helpers take a testing.TB), and booting the test image's guest
// under QEMU with the agent's disks, until its workload ticks.
package benchguest

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
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

// RunOnce runs f once inside a testing.B and exits with status 1 when it fails.
func RunOnce(f func(b *testing.B) error) {
	ran := false
	res := testing.Benchmark(func(b *testing.B) {
		if ran {
			return
		}
		ran = true
		b.StopTimer()
		if err := f(b); err != nil {
			b.Fatal(err)
		}
	})
	if res.N == 0 {
		os.Exit(1)
	}
}

// Host holds what guests boot from: the kernel, IMP's initramfs and the test image's base
// disk.
type Host struct {
	Dir, Kernel, Initramfs, BaseDisk string
}

// NewHost builds the guest artifacts and the test image's base disk in a temporary directory.
func NewHost(b *testing.B) (*Host, error) {
	tmp := b.TempDir()
	kernel, initrd := testguest.Artifacts(b, tmp)
	ref := testguest.Image(b, testregistry.Start(b, "", ""), "hello")
	base, _, err := (&disk.BaseStore{Dir: filepath.Join(tmp, "images"), MaxBytes: 1 << 30}).Ensure(context.Background(), "bench", ref, disk.PullSecretKeychain{})
	if err != nil {
		return nil, err
	}
	return &Host{Dir: tmp, Kernel: kernel, Initramfs: initrd, BaseDisk: base}, nil
}

// Boot starts a guest of memMiB running "hello serve" in the directory name and waits until
// its workload has ticked twice. The caller quits it (qemu.Quit(spec.Dir)).
func (h *Host) Boot(name string, memMiB int64) (qemu.Spec, *vmm.Record, error) {
	dir := filepath.Join(h.Dir, name)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return qemu.Spec{}, nil, err
	}
	rw, config := filepath.Join(dir, "rw.ext4"), filepath.Join(dir, "config.img")
	if err := (&disk.Writables{Dir: filepath.Join(filepath.Dir(rw), "templates")}).Ensure(rw, 64<<20); err != nil {
		return qemu.Spec{}, nil, err
	}
	if err := disk.WriteConfig(config, guestinit.Config{Argv: []string{"/bin/hello", "serve"}, Hostname: "bench"}); err != nil {
		return qemu.Spec{}, nil, err
	}
	spec := qemu.Spec{Dir: dir, Kernel: h.Kernel, Initramfs: h.Initramfs, BaseDisk: h.BaseDisk, WritableDisk: rw, ConfigDisk: config,
		VCPUs: 1, MemoryMiB: memMiB, Token: "t", Accel: qemu.Accel(), TSCkHz: qemu.TSCkHz()}
	rec, err := qemu.Start(spec, "bench")
	if err != nil {
		return spec, nil, err
	}
	go drain(dir)
	for deadline := time.Now().Add(3 * time.Minute); Ticks(dir) < 2; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			_ = qemu.Quit(dir)
			return spec, nil, fmt.Errorf("the %d MiB guest did not boot", memMiB)
		}
	}
	return spec, rec, nil
}

// Ticks counts the workload's ticks on the console of the guest in dir.
func Ticks(dir string) int {
	s, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLog))
	return strings.Count(string(s), "hello: tick ")
}

// drain is the agent's end of the guest channel, across suspensions (new VMMs in dir), until
// the benchmark ends.
func drain(dir string) {
	for {
		if c, err := qemu.DialChannel(dir); err == nil {
			_, _ = io.Copy(io.Discard, c)
			c.Close()
		}
		time.Sleep(50 * time.Millisecond)
	}
}
