package kubectlimp

import (
	"bytes"
	"io"
	"strings"
	"testing"
)

// A guest's output reaches a terminal inert: its controls are shown, never obeyed.
func TestInert(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"text", "hello, wörld\n\tindented\n", "hello, wörld\n\tindented\n"},
		{"CR LF of a serial console", "boot\r\nok\r\n", "boot\r\nok\r\n"},
		{"a lone CR overwriting a line", "secret\rpublic", "secret^Mpublic"},
		{"a title change", "\x1b]0;owned\x07", "^[]0;owned^G"},
		{"clearing the screen", "\x1b[2J\x1b[H", "^[[2J^[[H"},
		{"C1 CSI in UTF-8", "a\u009b31mred", "a<9b>31mred"},
		{"a bare C1 byte", "a\x9b31m", "a<9b>31m"},
		{"DEL and backspaces", "pass\x08\x08\x7f", "pass^H^H^?"},
		{"a three-byte character", "€ ok", "€ ok"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var b bytes.Buffer
			n, err := (&inert{w: &b}).Write([]byte(tc.in))
			if err != nil || n != len(tc.in) {
				t.Fatalf("wrote %d of %d: %v", n, len(tc.in), err)
			}
			if b.String() != tc.want {
				t.Errorf("%q became %q, want %q", tc.in, b.String(), tc.want)
			}
		})
	}
}

// A console's input ends where Ctrl-] is typed: what precedes it passes, nothing after it.
func TestDetachable(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"no detach key", "ls\r", "ls\r"},
		{"detach at once", "\x1d", ""},
		{"after a line", "ls\r\x1dmore", "ls\r"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := io.ReadAll(&detachable{r: strings.NewReader(tc.in)})
			if err != nil || string(got) != tc.want {
				t.Errorf("%q read as %q (%v), want %q", tc.in, got, err, tc.want)
			}
		})
	}
}
