package cgroup

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestPlace moves a real process into IMP's cgroups of this host's hierarchies and checks the
// kernel says it is there, outside the test's own cgroups.
func TestPlace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait(); Remove(Root, "test-place") }()
	used, err := Place(Root, "test-place", cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	lines, err := Of(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	in := 0
	for _, l := range lines {
		if strings.HasSuffix(l, "/"+Parent+"/test-place") {
			in++
		}
	}
	if in == 0 || in < len(used) {
		t.Errorf("placed in %v, but /proc says %v", used, lines)
	}
	self, _ := Of(os.Getpid())
	for _, l := range self {
		if strings.Contains(l, "/"+Parent+"/test-place") {
			t.Errorf("the test itself moved: %s", l)
		}
	}
}
