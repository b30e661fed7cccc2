// Package guestchan reads the guest channel as the untrusted input it is. Everything on it comes
// from inside the VM, where the workload runs as root and can take imp-init's end of the
// channel: lines are bounded (longer ones are dropped whole), and a message counts only once
// the channel has said hello with the VM's token, only if it is well formed, and only once
// (the first ready, the first exit or error). Nothing a guest sends can make the reader stop,
// allocate without bound, or produce a status the guest did not earn.
package guestchan

import (
	"bufio"
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"time"
	"unicode"

	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/guestinit/probe"
)

// MaxLine bounds one message; a longer line is dropped whole.
const MaxLine = 4096

// MaxMessage bounds the text of a guest's error that reaches the VM's status.
const MaxMessage = 512

// Kind is what a message means to the agent.
type Kind int

const (
	// None: the line changed nothing the agent reports (a hello, a repeat, anything ignored).
	None Kind = iota
	// Ready: the guest's workload started.
	Ready
	// Exit: the workload exited with Event.Code.
	Exit
	// Error: imp-init failed, with Event.Message.
	Error
	// Probe: a probe's verdict changed (Event.Probe, Event.OK, Event.Message): readiness
	// passing or failing, startup passing, a startup or liveness probe failing for good.
	Probe
	// Frozen: the guest says its workload is frozen (it was asked to, for a snapshot). It
	// changes no status; a guest saying it unasked, or falsely, makes its own snapshot's copies
	// share what its workload drew before their restore, nothing else.
	Frozen
	// Stats: the guest's own figures (Event.Stats), after ready, each consistent with itself;
	// what they say is the guest's word, counted for its own VM only.
	Stats
)

// Event is a message the agent acts on.
type Event struct {
	Kind    Kind
	Code    int32
	Message string
	Probe   probe.Kind
	OK      bool
	Stats   guestinit.Stats
	// Boot, on Ready, is how the guest says its boot went, when it holds together (nil else:
	// the ready counts all the same).
	Boot *guestinit.Boot
}

// Session is one run's guest channel as the agent trusts it.
type Session struct {
	token  string
	authed bool
	ready  bool
	ended  bool
	// killed: a startup or liveness probe failed; the run is ending.
	killed bool
	// Freezes: the guest's hello offered to freeze its workload for a snapshot.
	Freezes bool
	// Ignored counts lines dropped: malformed, oversized, unauthenticated, out of order.
	Ignored int
	// Why says why the last line was dropped, for a log line.
	Why string
}

// Trusted says whether the channel's last hello had the VM's token.
func (s *Session) Trusted() bool { return s.authed }

// NewSession expects hello with token before anything else.
func NewSession(token string) *Session { return &Session{token: token} }

// Feed takes one line (without its newline) and returns the event it carries, if any.
func (s *Session) Feed(line []byte) Event {
	ev, why := s.feed(line)
	if why != "" {
		s.Ignored++
		s.Why = why
	}
	return ev
}

func (s *Session) feed(line []byte) (Event, string) {
	if len(line) > MaxLine {
		return Event{}, "oversized"
	}
	var msg guestinit.Message
	if err := json.NewDecoder(bytes.NewReader(line)).Decode(&msg); err != nil {
		return Event{}, "malformed"
	}
	if msg.Event == "hello" {
		// A hello with another token makes the channel untrusted again: whoever speaks
		// next must prove the token anew.
		s.authed = s.token != "" && subtle.ConstantTimeCompare([]byte(msg.Token), []byte(s.token)) == 1
		if !s.authed {
			return Event{}, "hello with the wrong token"
		}
		s.Freezes = msg.Freezes
		return Event{}, ""
	}
	if !s.authed {
		return Event{}, "before hello"
	}
	if s.ended {
		return Event{}, "after the run's end"
	}
	switch msg.Event {
	case "ready":
		if s.ready {
			return Event{}, "ready again"
		}
		s.ready = true
		return Event{Kind: Ready, Boot: bootOf(msg.Boot)}, ""
	case "exit":
		if msg.Code == nil || *msg.Code < 0 || *msg.Code > 255 {
			return Event{}, "exit without a code from 0 to 255"
		}
		s.ended = true
		return Event{Kind: Exit, Code: int32(*msg.Code)}, ""
	case "error":
		s.ended = true
		return Event{Kind: Error, Message: Sanitize(msg.Message)}, ""
	case "probe":
		return s.probe(msg)
	case guestinit.FrozenEvent:
		return Event{Kind: Frozen}, ""
	case guestinit.StatsEvent:
		return stats(s.ready, msg.Stats)
	}
	return Event{}, "unknown event"
}

// probe takes a probe's verdict: only while the workload runs (after ready, before its end),
// only of a known probe, and a startup or liveness failure only once.
func (s *Session) probe(msg guestinit.Message) (Event, string) {
	if !s.ready {
		return Event{}, "a probe before ready"
	}
	if msg.OK == nil {
		return Event{}, "a probe without a verdict"
	}
	ev := Event{Kind: Probe, Probe: probe.Kind(msg.Probe), OK: *msg.OK}
	if !ev.OK {
		ev.Message = Sanitize(msg.Message)
	}
	switch ev.Probe {
	case probe.Readiness:
		if s.killed {
			return Event{}, "a readiness verdict after a kill"
		}
	case probe.Startup, probe.Liveness:
		if s.killed {
			return Event{}, "a second kill"
		}
		s.killed = !ev.OK
	default:
		return Event{}, "an unknown probe"
	}
	return ev, ""
}

// maxBoot bounds the boot a guest may claim: an hour, in microseconds.
const maxBoot = uint64(time.Hour / time.Microsecond)

// bootOf is b when it holds together: at most MaxBootPhases phases, each of guestinit's names,
// in order in time, from imp-init's start to ready, within maxBoot.
func bootOf(b *guestinit.Boot) *guestinit.Boot {
	if b == nil || len(b.Phases) > guestinit.MaxBootPhases || b.Ready > maxBoot || b.Init > b.Ready {
		return nil
	}
	at := b.Init
	for _, p := range b.Phases {
		if !slices.Contains(guestinit.BootPhases, p.Name) || p.Start < at || p.End < p.Start || p.End > b.Ready {
			return nil
		}
		at = p.End
	}
	return b
}

// stats takes a guest's figures: after ready, and only figures that hold together (available
// memory within the total, free space within the size). Bounds by the VM's size are the
// reader's (the channel does not know it).
func stats(ready bool, st *guestinit.Stats) (Event, string) {
	switch {
	case !ready:
		return Event{}, "stats before ready"
	case st == nil:
		return Event{}, "stats without figures"
	case st.MemoryAvailable > st.MemoryTotal || st.FilesystemFree > st.FilesystemSize:
		return Event{}, "stats that contradict themselves"
	}
	return Event{Kind: Stats, Stats: *st}, ""
}

// Sanitize makes a guest's text fit for a status: printable, one line, at most MaxMessage
// bytes.
func Sanitize(s string) string {
	s = strings.Map(func(r rune) rune {
		switch {
		case r == unicode.ReplacementChar:
			return '?'
		case !unicode.IsPrint(r):
			return ' '
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
	if len(s) > MaxMessage {
		s = strings.ToValidUTF8(s[:MaxMessage], "") + "…"
	}
	return s
}

// tooLong stands for a line ReadLines dropped.
var tooLong = make([]byte, MaxLine+1)

// ReadLines calls f with each line of r, without its newline, dropping lines longer than
// MaxLine whole (f sees an oversized placeholder instead, so it can count them). It returns
// when r does, with r's error (nil at EOF).
func ReadLines(r io.Reader, f func([]byte)) error {
	return readLines(r, func(line []byte) bool { f(line); return false })
}

// readLines is ReadLines until f returns true.
func readLines(r io.Reader, f func([]byte) (stop bool)) error {
	return readBuffered(bufio.NewReaderSize(r, MaxLine+1), f)
}

// readBuffered is readLines from br, a reader of at least MaxLine+1 bytes: what br holds past
// the line f stopped at stays in it.
func readBuffered(br *bufio.Reader, f func([]byte) (stop bool)) error {
	oversized := false
	for {
		line, err := br.ReadSlice('\n')
		switch {
		case errors.Is(err, bufio.ErrBufferFull):
			oversized = true // the rest of this line is dropped too
			continue
		case err != nil && !errors.Is(err, io.EOF):
			return err
		}
		if len(line) > 0 || err == nil {
			stop := false
			if oversized {
				stop = f(tooLong)
			} else {
				stop = f(bytes.TrimSuffix(line, []byte("\n")))
			}
			oversized = false
			if stop {
				return nil
			}
		}
		if err != nil {
			return nil
		}
	}
}
