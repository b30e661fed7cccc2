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
	run := func(guest func(r *bufio.Reader, w net.Conn)) error {
		_, err := restore(guest)
		return err
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

var req = guestinit.Restore{Token: "new", Entropy: make([]byte, 32)}

// restore asks a restore of a guest played by guest, over a pipe.
func restore(guest func(r *bufio.Reader, w net.Conn)) (*Answered, error) {
	host, g := net.Pipe()
	go func() {
		defer g.Close()
		guest(bufio.NewReader(g), g)
	}()
	a, err := Restore(host, "old", req, 500*time.Millisecond)
	if err != nil {
		host.Close()
	}
	return a, err
}

func asked(r *bufio.Reader) guestinit.Request {
	line, _ := r.ReadBytes('\n')
	var q guestinit.Request
	_ = json.Unmarshal(line, &q)
	return q
}

func send(w net.Conn, m guestinit.Message) {
	b, _ := json.Marshal(m)
	_, _ = w.Write(append(b, '\n'))
}

// TestRestoreHandsOnWhatFollows: what the guest sends after its answer (its replay) is read
// from the answered connection, first; the connection says whether the replay comes (only a
// restored event saying so: an older imp-init sends none, and a hello answer was the replay's
// first line, which the connection must be told again).
func TestRestoreHandsOnWhatFollows(t *testing.T) {
	for _, tc := range []struct {
		name     string
		answer   guestinit.Message
		replayed bool
	}{
		{"replay follows", guestinit.Message{Event: guestinit.RestoredEvent, Token: "new", Replay: true}, true},
		{"an older guest", guestinit.Message{Event: guestinit.RestoredEvent, Token: "new"}, false},
		{"hello", guestinit.Message{Event: "hello", Token: "new"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, err := restore(func(r *bufio.Reader, w net.Conn) {
				asked(r)
				// One write, so that the answer and what follows reach the host's buffer
				// together.
				var b []byte
				for _, m := range []guestinit.Message{tc.answer, {Event: "hello", Token: "new"}, {Event: "ready"}} {
					line, _ := json.Marshal(m)
					b = append(append(b, line...), '\n')
				}
				_, _ = w.Write(b)
			})
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			if a.Replayed != tc.replayed {
				t.Errorf("replayed %v, want %v", a.Replayed, tc.replayed)
			}
			var got []string
			_ = ReadLines(a, func(line []byte) { got = append(got, string(line)) })
			if want := []string{`{"event":"hello","token":"new"}`, `{"event":"ready"}`}; strings.Join(got, "|") != strings.Join(want, "|") {
				t.Errorf("read after the answer %q, want %q", got, want)
			}
		})
	}
}
