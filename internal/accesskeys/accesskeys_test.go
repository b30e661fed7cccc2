package accesskeys

import (
	"strings"
	"testing"
)

const (
	ed1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHJ0b2VtZ2ZzZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2Rm one@imp"
	ed2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDJ0b2VtZ2ZzZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2Rm two@imp"
)

// TestLines: a Secret's values are lines of keys, comments and blank lines left out; what is
// not a key (text a guest's file would take for options or a command, a control
// character that would make one line two) is refused with where it is.
func TestLines(t *testing.T) {
	got, err := Lines(map[string][]byte{"b": []byte(ed2 + "\n"), "a": []byte("# mine\r\n\r\n  " + ed1 + "\r\n")}) // CRLF: a file from Windows
	if err != nil || strings.Join(got, "|") != ed1+"|"+ed2 {
		t.Fatalf("Lines: %q %v", got, err)
	}
	for _, bad := range []string{
		"not a key",
		"command=\"rm -rf /\" not-a-key AAAA",
		"ssh-ed25519 AAAA\x00",
		ed1 + "\rssh-ed25519 AAAA",
	} {
		if got, err := Lines(map[string][]byte{"k": []byte(bad)}); err == nil || !strings.Contains(err.Error(), "key k, line 1") {
			t.Errorf("Lines(%q) = %q, %v; want an error naming key k, line 1", bad, got, err)
		}
	}
}

// TestDigest: the digest is of what the users get, whatever order the Secrets gave it in.
func TestDigest(t *testing.T) {
	a := Keys{"alice": {ed1, ed2}, "bob": {}}
	b := Keys{"bob": {}, "alice": {ed1, ed2}}
	if a.Digest() != b.Digest() {
		t.Error("the same keys have two digests")
	}
	if a.Digest() == (Keys{"alice": {ed1, ed2}}).Digest() {
		t.Error("a user given no keys does not change the digest")
	}
	d, err := Decode(a.Encode())
	if err != nil || d.Digest() != a.Digest() {
		t.Errorf("decoded %v %v", d, err)
	}
}
