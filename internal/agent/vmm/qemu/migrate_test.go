package qemu

import (
	"io"
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
	dst.WritableDisk = filepath.Join(dst.Dir, "rw.ext4")
	if err := copyInto(src.WritableDisk, dst.WritableDisk); err != nil {
		t.Fatal(err)
	}
	dst.MigrationIn = true

	// First, a receiver that is gone: the guest runs on where it was.
	a, b := socketPair(t)
	b.Close()
	if _, err := MigrateOut(src.Dir, a, 300*time.Millisecond, 0, nil, time.Minute); err == nil {
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
	a, b = socketPair(t)
	in := make(chan error, 1)
	go func() { in <- MigrateIn(dst.Dir, recB, b, time.Minute) }()
	stats, err := MigrateOut(src.Dir, a, 300*time.Millisecond, 0, nil, 2*time.Minute)
	if err != nil {
		t.Fatalf("%v; the receiver's log: %s", err, LogTail(dst.Dir, 500))
	}
	if err := <-in; err != nil {
		t.Fatal(err)
	}
	a.Close()
	b.Close()
	// The guest is paused on both: its disk is made whole on the receiver, then it runs there.
	atMove := consoleOf(src.Dir)
	if err := copyInto(src.WritableDisk, dst.WritableDisk); err != nil {
		t.Fatal(err)
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

// copyInto writes the whole of file from over file to, in place (a VMM holds it open).
func copyInto(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Chown(guestUID, guestUID); err != nil {
		out.Close()
		return err
	}
	return out.Close()
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
