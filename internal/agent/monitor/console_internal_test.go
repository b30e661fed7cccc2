package monitor

import (
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/agent/vmmdriver"
)

// A guest that reads nothing of its console holds a writer for the write timeout, no longer;
// the console opens again for the next write, and refuses every write once the run ended.
func TestConsoleOfAGuestThatDoesNotRead(t *testing.T) {
	guests := make(chan net.Conn, 2)
	c := &console{timeout: 200 * time.Millisecond, open: func() (vmmdriver.ConsoleWriter, error) {
		host, guest := net.Pipe() // unbuffered: a write waits for a read
		guests <- guest
		return host, nil
	}}
	in := &consoleInput{c: c}
	c.attach()
	start := time.Now()
	_, err := in.Write([]byte("typed\r"))
	if err == nil || !strings.Contains(err.Error(), "read nothing of its console") {
		t.Fatalf("a write to a console no one reads: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("the write was held %v", d)
	}
	<-guests

	// A guest that reads again gets the next write, on a new connection.
	done := make(chan error, 1)
	go func() {
		_, err := in.Write([]byte("again\r"))
		done <- err
	}()
	b := make([]byte, 16)
	n, _ := io.ReadAtLeast(<-guests, b, len("again\r"))
	if err := <-done; err != nil || string(b[:n]) != "again\r" {
		t.Fatalf("the write after a reopen: %v, read %q", err, b[:n])
	}

	// The last attachment closes the connection; after the run, no write goes anywhere.
	in.Close()
	if c.w != nil {
		t.Error("the console stayed open with no one attached")
	}
	c.end()
	if _, err := (&consoleInput{c: c}).Write([]byte("late\r")); !errors.Is(err, ErrNotRunning) {
		t.Errorf("a write after the run ended: %v", err)
	}
}
