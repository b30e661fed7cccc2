package qemu

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/syscode-labs/imp/internal/agent/transfer"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/pki"
)

// TestLiveMigration moves a running guest (a 256 MiB guest under TCG, its workload counting on
// the console) from one QEMU to another, live, its disk mirrored first, both through the
// agents' transfer (streams over mutually authenticated TLS, each bridged to a VMM's socket): the count goes on in the second from where the first stopped, the workload is
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
	// Both of the VMMs' connections go through the agents' transfer as a migration's do: node
	// b's agent (the receiver's) takes the streams node a's agent opens, over mutually
	// authenticated TLS; each agent bridges a stream to a socket its VMM holds.
	nodeA, nodeB := agentIdentities(t)
	nbd, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(t.TempDir(), "nbd.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lnFile, _ := nbd.File()
	if err := ServeDisk(dst.Dir, recB, lnFile, []string{WritableDrive}, time.Minute); err != nil {
		t.Fatalf("%v; the receiver's log: %s", err, LogTail(dst.Dir, 500))
	}
	lnFile.Close()
	in := make(chan error, 1)
	streams := &transfer.Streams{Authorize: func(_ context.Context, node string, _ types.UID, name string) (func(net.Conn), error) {
		if node != "node-a" {
			return nil, transfer.ErrNotAllowed
		}
		switch name {
		case "disk": // to the receiving VMM's disk server
			return func(c net.Conn) {
				if d, err := net.Dial("unix", nbd.Addr().String()); err == nil {
					transfer.Bridge(c, d)
				}
			}, nil
		case "memory": // to the receiving VMM's migration socket
			return func(c net.Conn) {
				mine, vmms := socketPair(t)
				go func() { in <- MigrateIn(dst.Dir, recB, vmms, time.Minute); vmms.Close() }()
				transfer.Bridge(c, mine)
			}, nil
		}
		return nil, transfer.ErrNotAllowed
	}}
	ts := httptest.NewUnstartedServer(streams.Handler())
	ts.TLS = transfer.ServerTLS(nodeB)
	ts.StartTLS()
	defer ts.Close()
	cfg, err := transfer.ClientTLS(nodeA, "node-b")
	if err != nil {
		t.Fatal(err)
	}
	// open opens stream name to node b's agent and returns the end the sending VMM gets.
	open := func(name string) *os.File {
		t.Helper()
		c, err := transfer.DialStream(context.Background(), cfg, strings.TrimPrefix(ts.URL, "https://"), "5f1c0a44-0d7e-4d3e-9a8e-2f6b1c9d0e11", name)
		if err != nil {
			t.Fatal(err)
		}
		mine, vmms := socketPair(t)
		go transfer.Bridge(c, mine)
		return vmms
	}
	// The disk first: mirrored while the guest runs.
	disk := open("disk")
	mirrored := time.Now()
	if err := MirrorDisk(src.Dir, disk, WritableDrive, time.Minute); err != nil {
		t.Fatalf("%v; the sender's log: %s; the receiver's: %s", err, LogTail(src.Dir, 500), LogTail(dst.Dir, 500))
	}
	disk.Close()
	t.Logf("the disk mirrored in %v", time.Since(mirrored).Round(time.Millisecond))
	memory := open("memory")
	stats, err := MigrateOut(src.Dir, memory, MigrateOptions{Downtime: 300 * time.Millisecond, MirroredDisk: true, Timeout: 2 * time.Minute})
	if err != nil {
		t.Fatalf("%v; the receiver's log: %s", err, LogTail(dst.Dir, 500))
	}
	memory.Close()
	if err := <-in; err != nil {
		t.Fatal(err)
	}
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
	t.Logf("live migration (256 MiB guest, TCG, through the agents' mTLS streams): total %v, downtime %v, %d MiB sent", stats.Total, stats.Downtime, stats.Bytes>>20)
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

// agentIdentities are node-a's and node-b's agent certificates under one CA.
func agentIdentities(t *testing.T) (a, b transfer.Identity) {
	t.Helper()
	ca, err := pki.NewCA("imp-agents", time.Now(), time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca.Cert)
	id := func(node string) transfer.Identity {
		leaf, err := pki.Issue(ca, pki.Request{CommonName: pki.AgentName, DNSNames: []string{pki.AgentDNSName(node)}, Server: true, Client: true, Lifetime: time.Hour}, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(leaf.Cert, leaf.Key)
		if err != nil {
			t.Fatal(err)
		}
		return func() (*tls.Certificate, *x509.CertPool, error) { return &cert, pool, nil }
	}
	return id("node-a"), id("node-b")
}
