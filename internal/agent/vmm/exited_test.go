package vmm

import (
	"context"
	"os/exec"
	"testing"
	"time"
)

// TestExited: the channel closes when the process ends, not before; a watch whose context
// ends lets go; a record whose pid is another process's (its start differs) has ended.
func TestExited(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = cmd.Wait() }()
	st, err := StartTime(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	rec := &Record{Pid: cmd.Process.Pid, StartTime: st}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	exited := rec.Exited(ctx)
	if exited == nil {
		t.Skip("no pidfd on this kernel")
	}
	other, stop := context.WithCancel(context.Background())
	otherExited := rec.Exited(other)
	select {
	case <-exited:
		t.Fatal("closed while the process runs")
	case <-time.After(300 * time.Millisecond):
	}
	stop() // this watch ends; its channel stays open
	_ = cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		t.Fatal("not closed 10 s after the process was killed")
	}
	select {
	case <-otherExited:
		t.Error("a watch whose context ended still reported the end")
	case <-time.After(100 * time.Millisecond):
	}

	gone := &Record{Pid: cmd.Process.Pid, StartTime: st}
	select {
	case <-gone.Exited(ctx):
	case <-time.After(time.Second):
		t.Error("a record of a process reaped is not ended")
	}
	// A live process that is not the recorded one (its pid reused).
	again := exec.Command("sleep", "30")
	if err := again.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = again.Process.Kill(); _ = again.Wait() }()
	reused := &Record{Pid: again.Process.Pid, StartTime: st}
	select {
	case <-reused.Exited(ctx):
	case <-time.After(time.Second):
		t.Error("a record of another start is not ended")
	}
}
