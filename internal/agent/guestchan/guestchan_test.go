package guestchan

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/syscode-labs/imp/internal/guestinit"
)

func TestSession(t *testing.T) {
	const token = "t0k"
	hello := `{"event":"hello","token":"t0k"}`
	tests := []struct {
		name  string
		lines []string
		want  []Event // the events, in order, that the lines produce
	}{
		{"a run", []string{hello, `{"event":"ready"}`, `{"event":"exit","code":3}`}, []Event{{Kind: Ready}, {Kind: Exit, Code: 3}}},
		{"nothing before hello", []string{`{"event":"ready"}`, `{"event":"exit","code":0}`}, nil},
		{"exit without a code", []string{hello, `{"event":"exit"}`}, nil},
		{"exit code out of range", []string{hello, `{"event":"exit","code":-1}`, `{"event":"exit","code":256}`, `{"event":"exit","code":4294967296}`}, nil},
		{"ready once", []string{hello, `{"event":"ready"}`, `{"event":"ready"}`}, []Event{{Kind: Ready}}},
		{"a ready's boot that holds together", []string{hello, `{"event":"ready","boot":{"init":100,"phases":[{"name":"mounts","start":100,"end":150},{"name":"workload","start":150,"end":300}],"ready":310}}`},
			[]Event{{Kind: Ready, Boot: &guestinit.Boot{Init: 100, Phases: []guestinit.Phase{{Name: "mounts", Start: 100, End: 150}, {Name: "workload", Start: 150, End: 300}}, Ready: 310}}}},
		{"a ready's boot that does not: the ready counts, not the boot", []string{hello, `{"event":"ready","boot":{"init":100,"phases":[{"name":"rm -rf","start":100,"end":150}],"ready":310}}`},
			[]Event{{Kind: Ready}}},
		{"the first end counts", []string{hello, `{"event":"exit","code":1}`, `{"event":"exit","code":2}`, `{"event":"error","message":"x"}`}, []Event{{Kind: Exit, Code: 1}}},
		{"a wrong hello untrusts the channel", []string{hello, `{"event":"hello","token":"guess"}`, `{"event":"ready"}`}, nil},
		{"the right hello trusts it again", []string{`{"event":"hello","token":"guess"}`, hello, `{"event":"ready"}`}, []Event{{Kind: Ready}}},
		{"a hello without a token", []string{`{"event":"hello"}`, `{"event":"ready"}`}, nil},
		{"not JSON", []string{hello, `ready`, `{"event":`, `[]`, `null`}, nil},
		{"oversized", []string{hello, `{"event":"ready","message":"` + strings.Repeat("x", MaxLine) + `"}`}, nil},
		{"unknown events", []string{hello, `{"event":"reboot"}`, `{"event":""}`}, nil},
		{"probes", []string{hello, `{"event":"probe","probe":"readiness","ok":true}`, `{"event":"ready"}`, `{"event":"probe","probe":"readiness","ok":true}`,
			`{"event":"probe","probe":"readiness","ok":false,"message":"HTTP 500\u001b"}`, `{"event":"probe","probe":"readiness"}`, `{"event":"probe","probe":"gossip","ok":true}`,
			`{"event":"probe","probe":"startup","ok":true}`, `{"event":"probe","probe":"liveness","ok":false,"message":"down"}`,
			`{"event":"probe","probe":"liveness","ok":false}`, `{"event":"probe","probe":"readiness","ok":true}`, `{"event":"exit","code":137}`, `{"event":"probe","probe":"readiness","ok":true}`},
			[]Event{{Kind: Ready}, {Kind: Probe, Probe: "readiness", OK: true}, {Kind: Probe, Probe: "readiness", Message: "HTTP 500 "}, {Kind: Probe, Probe: "startup", OK: true},
				{Kind: Probe, Probe: "liveness", Message: "down"}, {Kind: Exit, Code: 137}}},
		{"frozen, after hello only", []string{`{"event":"frozen"}`, hello, `{"event":"frozen"}`, `{"event":"frozen"}`}, []Event{{Kind: Frozen}, {Kind: Frozen}}},
		{"stats after ready, consistent only", []string{hello, `{"event":"stats","stats":{"memTotal":100,"memAvailable":40}}`, `{"event":"ready"}`,
			`{"event":"stats"}`, `{"event":"stats","stats":{"memTotal":100,"memAvailable":140}}`, `{"event":"stats","stats":{"fsSize":1,"fsFree":2}}`,
			`{"event":"stats","stats":{"memTotal":-1}}`, `{"event":"stats","stats":{"memTotal":100,"memAvailable":40,"cpuMillis":7,"fsSize":9,"fsFree":8}}`},
			[]Event{{Kind: Ready}, {Kind: Stats, Stats: guestinit.Stats{MemoryTotal: 100, MemoryAvailable: 40, CPUMillis: 7, FilesystemSize: 9, FilesystemFree: 8}}}},
		{"an error's text is tamed", []string{hello, `{"event":"error","message":"bad\u001b[2J\nthing` + strings.Repeat("é", 400) + `"}`},
			[]Event{{Kind: Error, Message: "bad [2J thing" + strings.Repeat("é", 249) + "…"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := NewSession(token)
			var got []Event
			for _, l := range tt.lines {
				if ev := s.Feed([]byte(l)); ev.Kind != None {
					got = append(got, ev)
				}
			}
			if len(got) != len(tt.want) {
				t.Fatalf("events %+v, want %+v", got, tt.want)
			}
			for i := range got {
				if !reflect.DeepEqual(got[i], tt.want[i]) {
					t.Errorf("event %d = %+v, want %+v", i, got[i], tt.want[i])
				}
			}
		})
	}
	// The offer to freeze is the authenticated hello's: a wrong hello's offer, or a later one's
	// withdrawal, stands as the last good hello said.
	s := NewSession(token)
	s.Feed([]byte(`{"event":"hello","token":"guess","freezes":true}`))
	if s.Freezes {
		t.Error("a wrong hello's offer to freeze was taken")
	}
	s.Feed([]byte(`{"event":"hello","token":"t0k","freezes":true}`))
	if !s.Freezes {
		t.Error("the hello's offer to freeze was not taken")
	}
	s.Feed([]byte(hello))
	if s.Freezes {
		t.Error("a hello without the offer left it standing")
	}
	if s := NewSession(""); s.Feed([]byte(`{"event":"hello","token":""}`)) != (Event{}) || s.authed {
		t.Error("a session without a token trusted a hello without one")
	}
}

func TestReadLines(t *testing.T) {
	in := "a\n" + strings.Repeat("x", 3*MaxLine) + "\nb\n" + strings.Repeat("y", MaxLine) + "\nc"
	var got []string
	if err := ReadLines(strings.NewReader(in), func(l []byte) {
		if len(l) > MaxLine {
			got = append(got, "<oversized>")
		} else {
			got = append(got, string(l))
		}
	}); err != nil {
		t.Fatal(err)
	}
	want := []string{"a", "<oversized>", "b", strings.Repeat("y", MaxLine), "c"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("lines = %.80q…, want %.80q…", got, want)
	}
}

// FuzzGuestChannel feeds whatever a guest could write through the line reader into a session:
// no panic, at most one ready and one end, nothing before the hello, codes in range, texts
// bounded and printable. make test runs it for a bounded time.
func FuzzGuestChannel(f *testing.F) {
	f.Add([]byte(`{"event":"hello","token":"t0k"}` + "\n" + `{"event":"ready"}` + "\n" + `{"event":"exit","code":0}` + "\n"))
	f.Add([]byte(`{"event":"exit"}` + "\n"))
	f.Add([]byte(`{"event":"hello","token":"t0k"}` + "\n" + `{"event":"error","message":"\u0000\u001b"}`))
	f.Add(bytes.Repeat([]byte("{"), 2*MaxLine))
	f.Add([]byte(`{"event":"hello","token":"t0k"}` + "\n" + `{"event":"ready"}` + "\n" + `{"event":"probe","probe":"liveness","ok":false,"message":"x"}` + "\n" + `{"event":"probe","probe":"readiness","ok":true}` + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		s := NewSession("t0k")
		authed, ready, ends, kills := false, 0, 0, 0
		_ = ReadLines(bytes.NewReader(data), func(line []byte) {
			var m struct{ Event, Token string }
			if len(line) <= MaxLine && json.NewDecoder(bytes.NewReader(line)).Decode(&m) == nil && m.Event == "hello" {
				authed = m.Token == "t0k"
			}
			ev := s.Feed(line)
			switch ev.Kind {
			case None:
				return
			case Ready:
				ready++
			case Exit:
				ends++
				if ev.Code < 0 || ev.Code > 255 {
					t.Fatalf("exit code %d", ev.Code)
				}
			case Probe:
				if ready == 0 || ends > 0 || kills > 0 && ev.Probe == "readiness" {
					t.Fatalf("probe %+v out of order", ev)
				}
				if !ev.OK && ev.Probe != "readiness" {
					kills++
				}
				if ev.OK && ev.Message != "" || len(ev.Message) > MaxMessage+len("…") || strings.ContainsAny(ev.Message, "\n\r\x1b\x00") {
					t.Fatalf("probe %+v", ev)
				}
			case Error:
				ends++
				if len(ev.Message) > MaxMessage+len("…") || !utf8.ValidString(ev.Message) || strings.ContainsAny(ev.Message, "\n\r\x1b\x00") {
					t.Fatalf("error text %q", ev.Message)
				}
			}
			if !authed {
				t.Fatalf("event %+v from an unauthenticated channel: %q", ev, line)
			}
		})
		if ready > 1 || ends > 1 || kills > 1 {
			t.Fatalf("%d ready, %d ends and %d kills", ready, ends, kills)
		}
	})
}

// TestBootOf: what a guest says of its boot counts only when it holds together.
func TestBootOf(t *testing.T) {
	ok := func() *guestinit.Boot {
		return &guestinit.Boot{Init: 10, Phases: []guestinit.Phase{{Name: "mounts", Start: 10, End: 20}, {Name: "disks", Start: 20, End: 40}}, Ready: 50}
	}
	if bootOf(ok()) == nil {
		t.Fatal("a boot that holds together was refused")
	}
	for name, change := range map[string]func(*guestinit.Boot){
		"an unknown phase":         func(b *guestinit.Boot) { b.Phases[1].Name = "<script>" },
		"a phase ending before it": func(b *guestinit.Boot) { b.Phases[0].End = 5 },
		"phases out of order":      func(b *guestinit.Boot) { b.Phases[1].Start = 15 },
		"a phase after ready":      func(b *guestinit.Boot) { b.Phases[1].End = 60 },
		"init after ready":         func(b *guestinit.Boot) { b.Init = 70 },
		"a boot of a year":         func(b *guestinit.Boot) { b.Ready = 365 * 24 * uint64(time.Hour/time.Microsecond) },
		"too many phases": func(b *guestinit.Boot) {
			for range guestinit.MaxBootPhases {
				b.Phases = append(b.Phases, guestinit.Phase{Name: "workload", Start: 40, End: 40})
			}
		},
	} {
		b := ok()
		change(b)
		if bootOf(b) != nil {
			t.Errorf("%s was taken", name)
		}
	}
}
