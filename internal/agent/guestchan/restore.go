package guestchan

import (
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// ErrRestoreTimeout: the guest did not answer a restore in time.
var ErrRestoreTimeout = errors.New("the restored guest did not take on its identity in time")

// deadliner is a connection whose reads can be bounded in time.
type deadliner interface {
	io.ReadWriter
	SetDeadline(t time.Time) error
}

// Restore gives the guest at the end of conn, restored from a snapshot whose token is old, its
// own identity (req), and waits up to timeout for its answer. A guest that already took it on
// (an agent that stopped in between asks again) says hello with req.Token: that is an answer
// too. What the guest sends is read as the untrusted input it is: bounded lines, and only a
// hello or a restored event with the new token counts; an error event ends the wait with the
// guest's (sanitized) message.
func Restore(conn deadliner, old string, req guestinit.Restore, timeout time.Duration) error {
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return err
	}
	line, err := json.Marshal(guestinit.Request{Op: "restore", Token: old, Restore: &req})
	if err != nil {
		return err
	}
	// Asked at once: the guest reads requests whether or not it has told this connection its
	// history yet.
	if _, err := conn.Write(append(line, '\n')); err != nil {
		return fmt.Errorf("asking the guest to take on its identity: %w", err)
	}
	var answer error
	done := errors.New("done")
	err = readLines(conn, func(b []byte) bool {
		var msg guestinit.Message
		if json.Unmarshal(b, &msg) != nil {
			return false
		}
		newToken := msg.Token != "" && subtle.ConstantTimeCompare([]byte(msg.Token), []byte(req.Token)) == 1
		switch {
		case (msg.Event == "hello" || msg.Event == guestinit.RestoredEvent) && newToken:
			answer = done
		case msg.Event == "error" && strings.HasPrefix(msg.Message, guestinit.RestoreErrorPrefix):
			answer = fmt.Errorf("the guest failed to take on its identity: %s", Sanitize(strings.TrimPrefix(msg.Message, guestinit.RestoreErrorPrefix)))
		}
		return answer != nil
	})
	switch {
	case errors.Is(answer, done):
		return nil
	case answer != nil:
		return answer
	case isTimeout(err):
		return ErrRestoreTimeout
	case err != nil:
		return fmt.Errorf("reading the restored guest's channel: %w", err)
	}
	return fmt.Errorf("the restored guest's channel closed before it took on its identity")
}

func isTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}
