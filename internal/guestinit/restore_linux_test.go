package guestinit

import (
	"encoding/json"
	"os"
	"reflect"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRestoredConfig: a restored guest takes the configuration its request carries and refuses
// one with nothing to run. (Without one it reads its configuration disk: agent.TestSnapshotRestore
// with a guest of this imp-init covers the request; the disk's reading is the boot's.)
func TestRestoredConfig(t *testing.T) {
	want := Config{Argv: []string{"/serve"}, Env: []string{"A=1"}, Hostname: "copy-1"}
	got, err := restoredConfig(&Restore{Config: &want})
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("restoredConfig = %+v, %v; want the request's %+v", got, err, want)
	}
	if _, err := restoredConfig(&Restore{Config: &Config{}}); err == nil {
		t.Error("a configuration with no command was taken")
	}
}

// TestReseedThroughTheKeptURandom: a restore reseeds through the /dev/urandom opened at boot,
// and keeps it open for the next (a guest is restored again from its own snapshots); it
// refuses too little entropy. Needs CAP_SYS_ADMIN (RNDADDENTROPY), as imp-init has.
func TestReseedThroughTheKeptURandom(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("RNDADDENTROPY needs root")
	}
	prepareRestore()
	if urandom == nil {
		t.Fatal("/dev/urandom not kept open")
	}
	t.Cleanup(func() { urandom.Close(); urandom = nil })
	entropy := make([]byte, 64)
	for i := range 2 {
		if err := reseed(entropy); err != nil {
			t.Fatalf("reseed %d: %v", i+1, err)
		}
	}
	if _, err := unix.FcntlInt(urandom.Fd(), unix.F_GETFD, 0); err != nil {
		t.Errorf("the kept /dev/urandom was closed: %v", err)
	}
	if err := reseed(entropy[:16]); err == nil {
		t.Error("16 bytes of entropy were taken")
	}
}

// TestTheReplayFollowsTheAnswer: a restore's answer carries the new token and says the replay
// follows, which it does, on the same queue, when the queue takes all of it; when it would not
// (a host away long enough to fill it), the answer says no replay follows and none is queued,
// so that the agent asks for it rather than wait for lines that were dropped.
func TestTheReplayFollowsTheAnswer(t *testing.T) {
	decode := func(line []byte) Message {
		var m Message
		if err := json.Unmarshal(line, &m); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		return m
	}
	c := &channel{token: "old", out: make(chan []byte, 64)}
	c.send(Message{Event: "hello", Token: "old"})
	c.send(Message{Event: "ready"})
	c.send(Message{Event: "probe", Probe: "readiness", OK: ptr(true)})
	for len(c.out) > 0 {
		<-c.out // written to the host
	}
	c.retoken("new")
	c.answerRestore("new")
	var got []Message
	for len(c.out) > 0 {
		got = append(got, decode(<-c.out))
	}
	// (The snapshot's probe verdicts are not the copy's: its probes report afresh.)
	if len(got) != 3 || got[0].Event != RestoredEvent || got[0].Token != "new" || !got[0].Replay ||
		got[1].Event != "hello" || got[1].Token != "new" || got[2].Event != "ready" {
		t.Fatalf("queued %+v; want the answer saying the replay follows, then the replay with the new token", got)
	}

	// A queue with room for the answer alone.
	for len(c.out) < cap(c.out)-2 {
		c.out <- []byte("{}\n")
	}
	c.answerRestore("new")
	var last Message
	for len(c.out) > 0 {
		last = decode(<-c.out)
	}
	if last.Event != RestoredEvent || last.Replay {
		t.Fatalf("the last line queued with the queue near full: %+v; want the answer, saying no replay follows", last)
	}
}

func ptr[T any](v T) *T { return &v }
