package firecracker_test

import (
	"bufio"
	"context"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest"
)

// TestJailSocketLinksAreNotFollowed: two jails, A and B, each with a fake Firecracker's API
// socket and vsock socket in run/. A's compromised VMM replaces its sockets with links to B's
// (and, another time, its whole run/ with a link to B's run/), and its snapshot/ with a link to
// B's: the agent's Ctrl-Alt-Del, guest channel dial and snapshot check and removal for A never
// reach B. The host paths the agent dialled before (which follow links) do reach B, so the
// links are a real attack.
func TestJailSocketLinksAreNotFollowed(t *testing.T) {
	base := t.TempDir()
	a, b := filepath.Join(base, "a"), filepath.Join(base, "b")
	for _, d := range []string{a, b} {
		for _, sub := range []string{"run", "snapshot"} {
			if err := os.MkdirAll(filepath.Join(d, sub), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
	srvB, err := fctest.Serve(filepath.Join(b, "run/firecracker.socket"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srvB.Close() })
	srvB.Lock()
	srvB.Started = true // B's VM runs
	srvB.Unlock()
	vsockB, err := net.Listen("unix", filepath.Join(b, "run/vsock.sock"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { vsockB.Close() })
	var dialled atomic.Int64
	go func() {
		for {
			c, err := vsockB.Accept()
			if err != nil {
				return
			}
			dialled.Add(1)
			go func() { // as Firecracker does: the CONNECT line, then the acknowledgement
				defer c.Close()
				if _, err := bufio.NewReader(c).ReadString('\n'); err == nil {
					_, _ = c.Write([]byte("OK 1\n"))
				}
			}()
		}
	}()
	if err := os.WriteFile(filepath.Join(b, "snapshot/vm.mem"), []byte("B's memory"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	cad := func() int { srvB.Lock(); defer srvB.Unlock(); return srvB.CtrlAltDel }
	ctrlAltDel := func(c *firecracker.Client) error {
		return c.Do(ctx, "PUT", "/actions", firecracker.Action{ActionType: "SendCtrlAltDel"}, nil)
	}

	// B's own agent reaches B, by the jail and by the host path.
	if err := ctrlAltDel(firecracker.NewJailClient(b)); err != nil || cad() != 1 {
		t.Fatalf("B's jail client: %v, %d Ctrl-Alt-Del", err, cad())
	}
	if _, err := firecracker.DialChannel(b); err != nil || dialled.Load() != 1 {
		t.Fatalf("B's guest channel: %v, %d dials", err, dialled.Load())
	}

	for _, layout := range []string{"links in run/", "run/ a link"} {
		t.Run(layout, func(t *testing.T) {
			_ = os.RemoveAll(filepath.Join(a, "run"))
			if layout == "run/ a link" {
				if err := os.Symlink(filepath.Join(b, "run"), filepath.Join(a, "run")); err != nil {
					t.Fatal(err)
				}
			} else {
				_ = os.Mkdir(filepath.Join(a, "run"), 0o755)
				for _, s := range []string{"firecracker.socket", "vsock.sock"} {
					if err := os.Symlink(filepath.Join(b, "run", s), filepath.Join(a, "run", s)); err != nil {
						t.Fatal(err)
					}
				}
			}
			before, dials := cad(), dialled.Load()
			if err := ctrlAltDel(firecracker.NewClient(filepath.Join(a, "run/firecracker.socket"))); err != nil || cad() != before+1 {
				t.Fatalf("the link does not reach B by the host path (%v): no attack to stop", err)
			}
			before = cad()
			if err := ctrlAltDel(firecracker.NewJailClient(a)); err == nil {
				t.Error("A's jail client sent a request through A's link")
			}
			if _, err := firecracker.DialChannel(a); err == nil {
				t.Error("A's guest channel was dialled through A's link")
			}
			if cad() != before || dialled.Load() != dials {
				t.Errorf("B got %d Ctrl-Alt-Del and %d vsock dials meant for A", cad()-before, dialled.Load()-dials)
			}
		})
	}

	// Snapshot files: A's snapshot/ a link to B's.
	_ = os.RemoveAll(filepath.Join(a, "snapshot"))
	if err := os.Symlink(filepath.Join(b, "snapshot"), filepath.Join(a, "snapshot")); err != nil {
		t.Fatal(err)
	}
	if firecracker.ExistsInJail(a, "/snapshot/vm.mem") {
		t.Error("A's jail shows B's snapshot through a link")
	}
	_ = firecracker.RemoveInJail(a, "/snapshot/vm.mem")
	if _, err := os.Stat(filepath.Join(b, "snapshot/vm.mem")); err != nil {
		t.Errorf("removing A's snapshot removed B's: %v", err)
	}
}
