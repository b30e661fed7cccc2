package vmm

import (
	"os"
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
