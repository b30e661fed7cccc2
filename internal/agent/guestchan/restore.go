package guestchan

import (
	"bufio"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// ErrRestoreTimeout: the guest did not answer a restore in time.
var ErrRestoreTimeout = errors.New("the restored guest did not take on its identity in time")

// Restore gives the guest at the end of conn, restored from a snapshot whose token is old, its
// own identity (req), and waits up to timeout for its answer. A guest that already took it on
// (an agent that stopped in between asks again) says hello with req.Token: that is an answer
// too. What the guest sends is read as the untrusted input it is: bounded lines, and only a
// hello or a restored event with the new token counts; an error event ends the wait with the
// guest's (sanitized) message.
//
// It returns conn as it stands after the answer, to be read on: what the guest sent after its
// answer is read from it first.
func Restore(conn net.Conn, old string, req guestinit.Restore, timeout time.Duration) (*Answered, error) {
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err
	}
	line, err := json.Marshal(guestinit.Request{Op: "restore", Token: old, Restore: &req})
	if err != nil {
		return nil, err
	}
	// Asked at once: the guest reads requests whether or not it has told this connection its
	// history yet.
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return nil, fmt.Errorf("asking the guest to take on its identity: %w", err)
	}
	a := &Answered{Conn: conn, r: bufio.NewReaderSize(conn, MaxLine+1)}
	var answer error
	done := errors.New("done")
	err = readBuffered(a.r, func(b []byte) bool {
		var msg guestinit.Message
		if json.Unmarshal(b, &msg) != nil {
			return false
		}
		newToken := msg.Token != "" && subtle.ConstantTimeCompare([]byte(msg.Token), []byte(req.Token)) == 1
		switch {
		case (msg.Event == "hello" || msg.Event == guestinit.RestoredEvent) && newToken:
			answer = done
			// A hello was the replay's first line, read here: the connection must be told it
			// again.
			a.Replayed = msg.Event == guestinit.RestoredEvent && msg.Replay
		case msg.Event == "error" && strings.HasPrefix(msg.Message, guestinit.RestoreErrorPrefix):
			answer = fmt.Errorf("the guest failed to take on its identity: %s", Sanitize(strings.TrimPrefix(msg.Message, guestinit.RestoreErrorPrefix)))
		}
		return answer != nil
	})
	switch {
	case errors.Is(answer, done):
		return a, nil
	case answer != nil:
		return nil, answer
	case isTimeout(err):
		return nil, ErrRestoreTimeout
	case err != nil:
		return nil, fmt.Errorf("reading the restored guest's channel: %w", err)
	}
	return nil, fmt.Errorf("the restored guest's channel closed before it took on its identity")
}

// Answered is a restored guest's channel connection after its answer: reads take what the
// guest sent after the answer first.
type Answered struct {
	net.Conn
	r *bufio.Reader
	// Replayed: the guest's replay (what a new connection is told: its hello with the new
	// token, its ready, ...) follows the answer on this connection, so it need not be asked
	// for (an older imp-init does not send it).
	Replayed bool
}

func (a *Answered) Read(p []byte) (int, error) { return a.r.Read(p) }

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}
