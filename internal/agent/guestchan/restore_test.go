package guestchan

import (
	"bufio"
	"encoding/json"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// TestRestore: the agent asks with the snapshot's token and takes only an answer with the new
// one; a guest that says nothing times out, a failure says why, and what a hostile guest sends
// otherwise (floods, another token, oversized lines) is no answer.
func TestRestore(t *testing.T) {
	req := guestinit.Restore{Token: "new", Entropy: make([]byte, 32)}
	run := func(guest func(r *bufio.Reader, w net.Conn)) error {
		host, g := net.Pipe()
		defer host.Close()
		go func() {
			defer g.Close()
			guest(bufio.NewReader(g), g)
		}()
		return Restore(host, "old", req, 500*time.Millisecond)
	}
	asked := func(r *bufio.Reader) guestinit.Request {
		line, _ := r.ReadBytes('\n')
		var q guestinit.Request
		_ = json.Unmarshal(line, &q)
		return q
	}
	send := func(w net.Conn, m guestinit.Message) {
		b, _ := json.Marshal(m)
		_, _ = w.Write(append(b, '\n'))
	}
	if err := run(func(r *bufio.Reader, w net.Conn) {
		if q := asked(r); q.Op != "restore" || q.Token != "old" || q.Restore == nil || q.Restore.Token != "new" {
			t.Errorf("asked %+v", q)
		}
		send(w, guestinit.Message{Event: "hello", Token: "old"})
		_, _ = w.Write([]byte(strings.Repeat("x", MaxLine*2) + "\n"))
		send(w, guestinit.Message{Event: guestinit.RestoredEvent, Token: "forged"})
		send(w, guestinit.Message{Event: "error", Message: "an old failure"})
		send(w, guestinit.Message{Event: guestinit.RestoredEvent, Token: "new"})
		time.Sleep(time.Second)
	}); err != nil {
		t.Errorf("restored: %v", err)
	}
	// Asked again after an agent restart: the guest's hello has the new token already.
	if err := run(func(r *bufio.Reader, w net.Conn) {
		asked(r)
		send(w, guestinit.Message{Event: "hello", Token: "new"})
		time.Sleep(time.Second)
	}); err != nil {
		t.Errorf("restored before: %v", err)
	}
	if err := run(func(r *bufio.Reader, w net.Conn) {
		asked(r)
		send(w, guestinit.Message{Event: "error", Message: guestinit.RestoreErrorPrefix + "no disk\x1b[2J"})
		time.Sleep(time.Second)
	}); err == nil || !strings.Contains(err.Error(), "no disk") || strings.Contains(err.Error(), "\x1b") {
		t.Errorf("a failure: %v", err)
	}
	if err := run(func(r *bufio.Reader, w net.Conn) {
		asked(r)
		for i := 0; i < 1000; i++ {
			send(w, guestinit.Message{Event: "hello", Token: "old"})
		}
		time.Sleep(time.Second)
	}); err != ErrRestoreTimeout {
		t.Errorf("a guest that never answers: %v", err)
	}
}
