package qemu

import (
	"bytes"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// TestLiveMigration moves a running guest (a 256 MiB guest under TCG, its workload counting on
// the console) from one QEMU to another, live, over a socket pair as the agents' transfer
// carries it: the count goes on in the second from where the first stopped, the workload is
// not started again, the first stays paused; and a migration whose receiving VMM is gone
// leaves the guest running where it was.
func TestLiveMigration(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest under QEMU")
	}
	src := guestSpec(t, guestinit.Config{Argv: []string{"/bin/hello", "serve"}, Hostname: "counter"})
	recA, err := Start(src, "h")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscallKill(recA.Pid) })
	drainChannel(t, src.Dir)
	consoleOf := func(dir string) string { b, _ := os.ReadFile(filepath.Join(dir, ConsoleLog)); return string(b) }
	waitFor := func(what string, d time.Duration, f func() bool) {
		t.Helper()
		for deadline := time.Now().Add(d); !f(); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s; console:\n%s", what, consoleOf(src.Dir))
			}
		}
	}
	waitFor("no tick 3", 4*time.Minute, func() bool { return hasLine(consoleOf(src.Dir), "hello: tick 3") })

	// The receiving VMM: the same devices, a directory (and cgroup) of its own, a copy of
	// the writable disk that is made whole again while the guest is paused.
	dst := src
	dst.Dir = filepath.Join(filepath.Dir(src.Dir), "vm-b")
	if err := os.Mkdir(dst.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	// Its writable disk starts empty: the mirror fills it while the guest runs.
	dst.WritableDisk = filepath.Join(dst.Dir, "rw.ext4")
	if fi, err := os.Stat(src.WritableDisk); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(dst.WritableDisk, nil, 0o600); err != nil {
		t.Fatal(err)
	} else if err := os.Truncate(dst.WritableDisk, fi.Size()); err != nil {
		t.Fatal(err)
	}
	dst.MigrationIn = true

	// First, a receiver that is gone: the guest runs on where it was.
	a, b := socketPair(t)
	b.Close()
	if _, err := MigrateOut(src.Dir, a, MigrateOptions{Downtime: 300 * time.Millisecond, Timeout: time.Minute}); err == nil {
		t.Error("a migration to nobody completed")
	}
	a.Close()
	ticks := strings.Count(consoleOf(src.Dir), "hello: tick ")
	waitFor("the guest stopped counting after a failed migration", 30*time.Second, func() bool {
		return strings.Count(consoleOf(src.Dir), "hello: tick ") > ticks+1
	})

	recB, err := Start(dst, "h")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscallKill(recB.Pid) })
	// The disk first: the receiver serves it, the sender mirrors to it while the guest runs.
	nbd, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(t.TempDir(), "nbd.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lnFile, _ := nbd.File()
	if err := ServeDisk(dst.Dir, recB, lnFile, time.Minute); err != nil {
		t.Fatalf("%v; the receiver's log: %s", err, LogTail(dst.Dir, 500))
	}
	lnFile.Close()
	nbdConn, err := net.Dial("unix", nbd.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	connFile, _ := nbdConn.(*net.UnixConn).File()
	mirrored := time.Now()
	if err := MirrorDisk(src.Dir, connFile, time.Minute); err != nil {
		t.Fatalf("%v; the sender's log: %s; the receiver's: %s", err, LogTail(src.Dir, 500), LogTail(dst.Dir, 500))
	}
	connFile.Close()
	nbdConn.Close()
	t.Logf("the disk mirrored in %v", time.Since(mirrored).Round(time.Millisecond))
	a, b = socketPair(t)
	in := make(chan error, 1)
	go func() { in <- MigrateIn(dst.Dir, recB, b, time.Minute) }()
	stats, err := MigrateOut(src.Dir, a, MigrateOptions{Downtime: 300 * time.Millisecond, MirroredDisk: true, Timeout: 2 * time.Minute})
	if err != nil {
		t.Fatalf("%v; the receiver's log: %s", err, LogTail(dst.Dir, 500))
	}
	if err := <-in; err != nil {
		t.Fatal(err)
	}
	a.Close()
	b.Close()
	// The guest is paused on both, the receiver's disk the sender's, byte for byte; it runs
	// on the receiver.
	atMove := consoleOf(src.Dir)
	if err := StopDiskServer(dst.Dir); err != nil {
		t.Fatal(err)
	}
	srcDisk, _ := os.ReadFile(src.WritableDisk)
	dstDisk, _ := os.ReadFile(dst.WritableDisk)
	if len(srcDisk) == 0 || !bytes.Equal(srcDisk, dstDisk) {
		t.Fatalf("the receiver's disk (%d bytes) is not the sender's (%d bytes)", len(dstDisk), len(srcDisk))
	}
	drainChannel(t, dst.Dir)
	if err := ResumeIncoming(dst.Dir, recB, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Logf("live migration (256 MiB guest, TCG, one socket pair): total %v, downtime %v, %d MiB sent", stats.Total, stats.Downtime, stats.Bytes>>20)
	last := strings.Count(atMove, "hello: tick ")
	waitFor("no tick on the receiver", 30*time.Second, func() bool {
		return strings.Count(consoleOf(dst.Dir), "hello: tick ") >= 2
	})
	after := consoleOf(dst.Dir)
	if strings.Contains(after, "hello from imp") || hasLine(after, "hello: tick 0") || hasLine(after, "hello: tick 1") {
		t.Errorf("the workload started again on the receiver instead of continuing:\n%s", after)
	}
	// The sender printed ticks 0 to last-1; the receiver's first is the next (or one more, if
	// the tick came due during the pause).
	first := -1
	for _, line := range strings.Split(after, "\n") {
		if n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), "hello: tick "))); err == nil && strings.Contains(line, "hello: tick ") {
			first = n
			break
		}
	}
	if first < last || first > last+3 {
		t.Errorf("the receiver's first tick is %d; the sender's last was %d:\n%s", first, last-1, after)
	}
	if got := consoleOf(src.Dir); got != atMove {
		t.Errorf("the sender's guest ran on after the migration:\n%s", got[len(atMove):])
	}
	if err := Quit(src.Dir); err != nil {
		t.Fatal(err)
	}
}

func socketPair(t *testing.T) (*os.File, *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	return os.NewFile(uintptr(fds[0]), "migration-out"), os.NewFile(uintptr(fds[1]), "migration-in")
}

// drainChannel reads the guest channel of the VM in dir as the agent does, until the test ends.
func drainChannel(t *testing.T, dir string) {
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	go func() {
		for {
			select {
			case <-done:
				return
			default:
			}
			if conn, err := DialChannel(dir); err == nil {
				_, _ = io.Copy(io.Discard, conn)
				conn.Close()
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
}
