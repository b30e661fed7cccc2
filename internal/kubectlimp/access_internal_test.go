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

// A refusal says why: a Status's message; for what the API server's aggregation answers itself
// (no such group, or IMP's access not available yet) where to look.
func TestRefusal(t *testing.T) {
	for _, tc := range []struct {
		name string
		code int
		body string
		want []string
	}{
		{"a Status", 503, `{"kind":"Status","message":"reaching the VM's node agent: refused"}`, []string{"503 reaching the VM's node agent: refused"}},
		{"no such group", 404, "404 page not found", []string{"does not serve subresources.imp.dev/v1alpha1", "access.enabled"}},
		{"the APIService not available", 503, "service unavailable\n", []string{"503 service unavailable", "kubectl get apiservice v1alpha1.subresources.imp.dev"}},
		{"anything else", 500, "boom", []string{"500 boom"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := refusal(tc.code, []byte(tc.body))
			for _, w := range tc.want {
				if !strings.Contains(got, w) {
					t.Errorf("refusal(%d, %q) = %q, want it to say %q", tc.code, tc.body, got, w)
				}
			}
		})
	}
}
