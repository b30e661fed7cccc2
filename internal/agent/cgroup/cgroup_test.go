package cgroup

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
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
	lim := Limits{MemoryBytes: 96 << 20, Pids: 42, CPUs: 1.5, Weight: 10}
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
		for _, f := range []string{"memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max", "cpu.cfs_quota_us", "cpu.weight", "cpu.shares"} {
			if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
				got[f] = strings.TrimSpace(string(b))
			}
		}
	}
	mem, pids, cpu := got["memory.max"]+got["memory.limit_in_bytes"], got["pids.max"], got["cpu.max"]+got["cpu.cfs_quota_us"]
	if mem != fmt.Sprint(96<<20) || pids != "42" || (cpu != "150000 100000" && cpu != "150000") {
		t.Errorf("limits memory %q, pids %q, cpu %q; want %d, 42, 1.5 CPUs", mem, pids, cpu, 96<<20)
	}
	// The CPU weight: a tenth of the default, then the default (a warm member handed over).
	if w := got["cpu.weight"] + got["cpu.shares"]; w != "10" && w != "102" {
		t.Errorf("cpu weight %q; want 10 (v2) or shares 102 (v1)", w)
	}
	if err := SetWeight(Root, "test-place", DefaultWeight); err != nil {
		t.Fatal(err)
	}
	w := ""
	for _, dir := range used {
		for _, f := range []string{"cpu.weight", "cpu.shares"} {
			if b, err := os.ReadFile(filepath.Join(dir, f)); err == nil {
				w += strings.TrimSpace(string(b))
			}
		}
	}
	if w != "100" && w != "1024" {
		t.Errorf("cpu weight after SetWeight %q; want 100 (v2) or shares 1024 (v1)", w)
	}
	self, _ := Of(os.Getpid())
	for _, l := range self {
		if strings.Contains(l, "/"+Parent+"/test-place") {
			t.Errorf("the test itself moved: %s", l)
		}
	}
}

// TestStartInUnified starts a real process in its prepared cgroup of the unified hierarchy
// (CLONE_INTO_CGROUP): /proc shows it there before anything moves it, then in every
// hierarchy once it joins the rest.
func TestStartInUnified(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	set, err := Prepare(Root, "test-born", Limits{MemoryBytes: 96 << 20, Pids: 42})
	if err != nil {
		t.Fatal(err)
	}
	defer Remove(Root, "test-born")
	f := set.Unified()
	if f == nil {
		if _, err := os.Stat(filepath.Join(Root, "unified", "cgroup.controllers")); err == nil || Version(Root) == 2 {
			t.Fatal("no cgroup of the unified hierarchy prepared, on a host that has one")
		}
		t.Skip("this host has no unified cgroup hierarchy")
	}
	defer f.Close()
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	lines, err := Of(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(lines, "0::/"+Parent+"/test-born") {
		t.Fatalf("started in %v, want 0::/%s/test-born", lines, Parent)
	}
	if _, err := set.Join(cmd.Process.Pid, true); err != nil {
		t.Fatal(err)
	}
	lines, _ = Of(cmd.Process.Pid)
	for _, l := range lines {
		if !strings.HasSuffix(l, "/"+Parent+"/test-born") {
			t.Errorf("joined, but /proc says %s", l)
		}
	}
}

// BenchmarkStart starts a process in its cgroup of the unified hierarchy alone, as on a
// cgroup v2 host: moved into it after it starts, or started in it; 50 ms apart.
//
//	go test -run '^$' -bench BenchmarkStart ./internal/agent/cgroup/
func BenchmarkStart(b *testing.B) {
	root := Root
	if Version(root) != 2 {
		root = filepath.Join(Root, "unified") // a hybrid host's
	}
	if os.Geteuid() != 0 || Version(root) != 2 {
		b.Skip("needs root and the unified cgroup hierarchy")
	}
	for _, born := range []bool{false, true} {
		b.Run(map[bool]string{false: "moved", true: "born"}[born], func(b *testing.B) {
			for i := 0; b.Loop(); i++ {
				name := fmt.Sprintf("bench-start-%d", i)
				set, err := Prepare(root, name, Limits{})
				if err != nil {
					b.Fatal(err)
				}
				cmd := exec.Command("sleep", "60")
				var f *os.File
				if born {
					f = set.Unified()
					cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(f.Fd())}
				}
				if err := cmd.Start(); err != nil {
					b.Fatal(err)
				}
				if _, err := set.Join(cmd.Process.Pid, born); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				if f != nil {
					f.Close()
				}
				_ = cmd.Process.Kill()
				_ = cmd.Wait()
				Remove(root, name)
				// Starts apart, as VMs' are: the kernel's cgroup lock is back to its
				// readers' fast path, which a move has to leave.
				time.Sleep(50 * time.Millisecond)
				b.StartTimer()
			}
		})
	}
}
