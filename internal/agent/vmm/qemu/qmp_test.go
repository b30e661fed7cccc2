package qemu

import (
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// TestQMPOfAVMMThatStreamsForever: a compromised QEMU answers the agent's QMP connection
// with a line that never ends, as fast as the agent reads: the agent gives up once the line
// passes MaxQMPLine, having read about that much, not at its deadline and not with its memory.
func TestQMPOfAVMMThatStreamsForever(t *testing.T) {
	for _, tc := range []struct{ name, first string }{
		{"the greeting", ""},
		{"an answer", `{"QMP": {"version": {}}}` + "\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			l, err := net.Listen("unix", filepath.Join(dir, QMPSock))
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			var sent atomic.Int64
			go func() {
				c, err := l.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				_, _ = c.Write([]byte(tc.first + `{"return": "`))
				chunk := []byte(strings.Repeat("a", 64<<10))
				for {
					n, err := c.Write(chunk)
					sent.Add(int64(n))
					if err != nil {
						return
					}
				}
			}()
			start := time.Now()
			_, err = DialQMP(dir, time.Minute)
			if err == nil || !strings.Contains(err.Error(), "longer than") {
				t.Fatalf("DialQMP: %v, want the line refused as too long", err)
			}
			if time.Since(start) > 30*time.Second {
				t.Errorf("refused after %s: at the deadline, not at the bound", time.Since(start))
			}
			if got := sent.Load(); got > 8*MaxQMPLine {
				t.Errorf("the agent read %d bytes of one line, bound %d", got, MaxQMPLine)
			}
		})
	}
}

// TestResumeOfAQEMUThatExitedBeforeListening: a resume whose QEMU is gone before it listened
// on QMP ends at once, saying so, rather than trying its socket until the timeout.
func TestResumeOfAQEMUThatExitedBeforeListening(t *testing.T) {
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	st, err := vmm.StartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	err = ResumeIncoming(t.TempDir(), &vmm.Record{Kind: "qemu", Pid: pid, StartTime: st}, 2*time.Second)
	if err == nil || !strings.Contains(err.Error(), "QEMU exited before it listened") {
		t.Fatalf("ResumeIncoming: %v; want it to say QEMU exited", err)
	}
}
