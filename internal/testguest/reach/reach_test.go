package reach

import (
	"bytes"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestProbe: a server answers its name over TCP and UDP; a port nothing serves is "-" on both.
func TestProbe(t *testing.T) {
	l, _ := net.Listen("tcp", "127.0.0.1:0")
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	go func() { _ = Serve("srv", port) }()
	at := "127.0.0.1:" + strconv.Itoa(port)
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := Try("tcp:"+at, time.Second); err == nil || time.Now().After(end) {
			break
		}
	}
	var out bytes.Buffer
	Probe(&out, 500*time.Millisecond, []string{"tcp:" + at, "udp:" + at, "tcp:127.0.0.1:1", "udp:127.0.0.1:1"})
	want := "tcp:" + at + " srv\nudp:" + at + " srv\ntcp:127.0.0.1:1 -\nudp:127.0.0.1:1 -\n"
	if out.String() != want {
		t.Errorf("probe:\n%s\nwant\n%s", out.String(), want)
	}
	out.Reset()
	Watch(&out, "tcp:"+at, 50*time.Millisecond, 200*time.Millisecond)
	if lines := strings.Split(strings.TrimSpace(out.String()), "\n"); len(lines) != 1 || !strings.HasSuffix(lines[0], " ok") {
		t.Errorf("watch of a steady server: %q", out.String())
	}
}
