package cgroup

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestPlace moves a real process into IMP's cgroups of this host's hierarchies and checks the
// kernel says it is there, in every hierarchy (cgroup v1's cpuset included), outside the
// test's own cgroups.
func TestPlace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); Remove(Root, "test-place") }()
	lim := Limits{MemoryBytes: 96 << 20, Pids: 42, CPUs: 1.5}
	used, err := Place(Root, "test-place", cmd.Process.Pid, lim)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := Of(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range lines {
		if !strings.HasSuffix(l, "/"+Parent+"/test-place") {
			t.Errorf("placed in %v, but /proc says %s", used, l)
		}
	}
	// The limits, in whichever files the hierarchies have.
	got := map[string]string{}
	for _, dir := range used {
		for _, f := range []string{"memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max", "cpu.cfs_quota_us"} {
			if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
				got[f] = strings.TrimSpace(string(b))
			}
		}
	}
	mem, pids, cpu := got["memory.max"]+got["memory.limit_in_bytes"], got["pids.max"], got["cpu.max"]+got["cpu.cfs_quota_us"]
	if mem != fmt.Sprint(96<<20) || pids != "42" || (cpu != "150000 100000" && cpu != "150000") {
		t.Errorf("limits memory %q, pids %q, cpu %q; want %d, 42, 1.5 CPUs", mem, pids, cpu, 96<<20)
	}
	self, _ := Of(os.Getpid())
	for _, l := range self {
		if strings.Contains(l, "/"+Parent+"/test-place") {
			t.Errorf("the test itself moved: %s", l)
		}
	}
}
