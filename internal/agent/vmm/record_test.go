package vmm

import (
	"os"
	"os/exec"
	"slices"
	"testing"
)

func TestStartTimeDistinguishesProcesses(t *testing.T) {
	self, err := StartTime(os.Getpid())
	if err != nil || self == 0 {
		t.Fatalf("StartTime(self) = %d, %v", self, err)
	}
	if !(&Record{Pid: os.Getpid(), StartTime: self}).Alive() {
		t.Error("this process is not alive by its record")
	}
	if (&Record{Pid: os.Getpid(), StartTime: self + 1}).Alive() {
		t.Error("a record with another start time matched this process (a reused pid would too)")
	}
}

// TestMarkedFindsEveryForm: a VM's VMM is found by its marker in each form a driver's process
// carries it — QEMU's "-name <uid>", the jailer's "--id <uid>", and "--id=<uid>" of the
// Firecracker the jailer execs (which the jailer's form alone missed) — and an unrecorded one
// is killed when the VM's intent says a start was under way.
func TestMarkedFindsEveryForm(t *testing.T) {
	const uid = "0c0ffee0-1111-2222-3333-444455556666"
	var pids []int
	for _, marker := range [][]string{{"-name", uid}, {"--id", uid}, {"--id=" + uid}} {
		cmd := exec.Command("/bin/sh", append([]string{"-c", "sleep 60", "vmm"}, marker...)...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		go func() { _ = cmd.Wait() }()
		t.Cleanup(func() { _ = cmd.Process.Kill() })
		pids = append(pids, cmd.Process.Pid)
	}
	got := Marked(uid)
	slices.Sort(got)
	slices.Sort(pids)
	if !slices.Equal(got, pids) {
		t.Fatalf("Marked = %v; want %v", got, pids)
	}
	dir := t.TempDir()
	if killed := KillUnrecorded(dir, uid); len(killed) != 0 {
		t.Errorf("killed %v without an intent", killed)
	}
	if err := WriteIntent(dir); err != nil {
		t.Fatal(err)
	}
	if killed := KillUnrecorded(dir, uid); len(killed) != 3 || len(Marked(uid)) != 0 || HasIntent(dir) {
		t.Errorf("killed %v, left %v, intent %v", killed, Marked(uid), HasIntent(dir))
	}
}
