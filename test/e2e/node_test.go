package e2e

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// nodeState is where hack/real-node.sh keeps the real node of the end-to-end tests: this
// machine joins their control plane as the node realNode. It is one fixed directory because a
// machine can be one node at a time (the pods' bridge, the kubepods cgroups), and so that a run
// that crashed is cleaned up by the next (TestMain).
const (
	nodeState = "/tmp/imp-e2e-node"
	realNode  = "imp-host"
)

// agentState is the imp-runtime pods' state directory on the real node (agent.stateDir).
var agentState = filepath.Join(nodeState, "var/lib/imp")

// TestMain starts the shared control plane of the API tests and undoes, before and after the
// tests, whatever an earlier run left on the host: a test that fails cleans up after itself,
// one that crashed (a timeout) cannot. `go test -short -run '^$' ./test/e2e` therefore cleans
// up alone (hack/test.sh runs it last).
func TestMain(m *testing.M) {
	if err := resetHost(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: cleaning up an earlier run:", err)
	}
	code := testcluster.Main(m, &shared, testcluster.WithoutCRDs())
	if err := resetHost(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: cleaning up:", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// resetHost puts the host back as it was before the real node joined: the VMs its agents
// started (they outlive their agent by design), the node itself (hack/real-node.sh down: its
// processes, mounts, sysctls, links, cgroups and Service rule), then what IMP's agent made in
// the node's network namespace and cgroups.
func resetHost() error {
	if _, err := os.Stat(nodeState); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	killVMMs(agentState)
	var errs []error
	root, err := testcluster.RepoRoot()
	if err != nil {
		return err
	}
	if out, err := exec.Command(filepath.Join(root, "hack/real-node.sh"), "down", nodeState).CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("hack/real-node.sh down: %v\n%s", err, out))
	}
	// The agent's node rules and transit links (their peers went with the networks'
	// namespaces, unmounted above, unless a process still held one).
	if c, err := nftables.New(); err == nil {
		if tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet); err == nil {
			for _, tb := range tables {
				if tb.Name == "imp" {
					c.DelTable(tb)
				}
			}
			if err := c.Flush(); err != nil {
				errs = append(errs, fmt.Errorf("deleting table inet imp: %w", err))
			}
		}
	}
	if links, err := netlink.LinkList(); err == nil {
		for _, l := range links {
			if strings.HasPrefix(l.Attrs().Name, "impe") {
				_ = netlink.LinkDel(l)
			}
		}
	}
	// The VMs' cgroups (those of other agents on this machine hold processes and stay).
	dirs, _ := filepath.Glob(filepath.Join(cgroup.Root, "*", cgroup.Parent, "*"))
	for _, d := range dirs {
		_ = os.Remove(d)
	}
	return errors.Join(errs...)
}

// killVMMs kills every VMM recorded under an agent's state directory: a failed test must not
// leave guests running.
func killVMMs(stateDir string) {
	recs, _ := filepath.Glob(filepath.Join(stateDir, "vms", "*", vmm.RecordFile))
	for _, p := range recs {
		if rec, err := vmm.ReadRecord(filepath.Dir(p)); err == nil && rec.Alive() {
			_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		}
	}
	if len(recs) > 0 {
		time.Sleep(200 * time.Millisecond) // their taps go with them
	}
}
