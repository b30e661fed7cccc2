// Package guestmem makes a QEMU snapshot's memory a file of its own and puts it back into a
// restored VM: Split turns the migration stream a snapshot saved (memory and devices, taken by
// QEMU in one consistent step while the guest is paused) into the guest's memory, page for page,
// and the devices' stream as QEMU's x-ignore-shared saves it; a restore then gives QEMU the
// memory as a memfd, and QEMU loads only the devices, instead of streaming every page through
// QEMU, which under TCG costs hundreds of milliseconds.
//
// The memfd is one of two. Cache keeps one per snapshot on the node, filled once and sealed
// against every change, which the restores of that snapshot map privately (copy-on-write): they
// copy nothing. The first restore of a snapshot, or one the cache does not hold, gets a memfd of
// its own, made per run (Create), sealed against resizing and filled (Fill) in a child process
// that runs in the VM's cgroups, so that its pages are charged to the VM as if the VMM had
// faulted them, never to the agent.
package guestmem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/snapshot"
)

// Create makes a VM's memory: a memfd of size bytes, sealed against growing and shrinking (a
// VMM has no reason to, and a memory that shrank under the fill would fault it).
func Create(name string, size int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("creating the guest's memory: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("sizing the guest's memory: %w", err)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
		f.Close()
		return nil, fmt.Errorf("sealing the guest's memory: %w", err)
	}
	return f, nil
}

// fillEnv marks the child process of Fill: Init sees it and fills instead of running the
// program.
const fillEnv = "IMP_GUESTMEM_FILL"

// fillWhole is fillEnv's value for a fill that allocates every page first.
const fillWhole = "whole"

// Fill copies the memory image img into mem (both the size of the guest's memory) in a child
// process: this program again (Init), moved by join into the VM's cgroups before it writes a
// page, so that the pages are charged there. The child stays the agent's uid: a cgroup, not a
// uid, is what is charged, and a child of the VM's uid could be traced by the VM's own QEMU. It
// waits for the child (within ctx) and returns its error.
func Fill(ctx context.Context, mem, img *os.File, join func(pid int) error) error {
	return fillIn(ctx, mem, img, false, join)
}

// fillIn is Fill; whole: the child allocates every page of mem before it copies (a cache's
// memory has no holes).
func fillIn(ctx context.Context, mem, img *os.File, whole bool, join func(pid int) error) error {
	mi, err := mem.Stat()
	if err != nil {
		return err
	}
	ii, err := img.Stat()
	if err != nil {
		return err
	}
	if !ii.Mode().IsRegular() || ii.Size() != mi.Size() {
		return fmt.Errorf("the memory image is %d bytes, not the guest's %d", ii.Size(), mi.Size())
	}
	gate, release, err := os.Pipe()
	if err != nil {
		return err
	}
	defer gate.Close()
	defer release.Close()
	var out limitedBuffer
	cmd := exec.CommandContext(ctx, "/proc/self/exe")
	mode := "1"
	if whole {
		mode = fillWhole
	}
	cmd.Env = []string{fillEnv + "=" + mode}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = gate, io.Discard, &out
	cmd.ExtraFiles = []*os.File{img, mem}
	cmd.WaitDelay = time.Second // the child's output closes with it
	// Pdeathsig is of the thread that forks, which must live until the child is done: a
	// thread the agent lets die (a network namespace's) would kill the fill.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting the memory fill: %w", err)
	}
	gate.Close()
	if err := join(cmd.Process.Pid); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("moving the memory fill into the VM's cgroups: %w", err)
	}
	if _, err := release.Write([]byte{1}); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("starting the memory fill: %w", err)
	}
	release.Close()
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("filling the guest's memory: %w: %s", err, out.String())
	}
	return nil
}

// Init runs the child of Fill and exits when this process is one; otherwise it returns at
// once. Programs that may restore a VM (the agent, and tests of it) call it first in main or
// TestMain.
func Init() {
	mode := os.Getenv(fillEnv)
	if mode != "1" && mode != fillWhole {
		return
	}
	if err := fill(mode == fillWhole); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// fill is the child: it waits until it is in the VM's cgroups (a byte on standard input), then
// copies descriptor 3 (the image) into descriptor 4 (the memory), allocating all of the memory
// first if whole.
func fill(whole bool) error {
	var b [1]byte
	if n, err := os.Stdin.Read(b[:]); n != 1 {
		return fmt.Errorf("not released: %w", err)
	}
	img, mem := os.NewFile(3, "image"), os.NewFile(4, "memory")
	if img == nil || mem == nil {
		return errors.New("no image or memory descriptor")
	}
	if whole {
		fi, err := mem.Stat()
		if err != nil {
			return err
		}
		if err := unix.Fallocate(int(mem.Fd()), 0, 0, fi.Size()); err != nil {
			return fmt.Errorf("allocating the memory: %w", err)
		}
	}
	return snapshot.Copy(img, mem)
}

// limitedBuffer keeps the first 4 KiB written to it: the child's error.
type limitedBuffer struct{ b []byte }

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := 4096 - len(l.b); room > 0 {
		l.b = append(l.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (l *limitedBuffer) String() string { return string(l.b) }
