package guestinit

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/guestsession"
)

// TestKeyWriter: the guest side gives users their SSH keys in a block of their
// authorized_keys, replaced whole (a rotated key is gone), the user's own lines kept, a user
// taken out emptied (after a restart too), a user the OS lacks pending; and it is not led
// astray by what a user owns: a ~/.ssh or an authorized_keys that is a symlink (to a file
// root's write would replace), a FIFO (a read that never ends), a hard link to root's file, a
// ~/.ssh another user made; nor by a key line that would be two, or a user's name that is a
// path.
func TestKeyWriter(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: it gives files to users")
	}
	root := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	must(os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/bash\n"+
		"alice:x:1000:1000::/home/alice:/bin/bash\nbob:x:1001:1001::/home/bob:/bin/bash\nmallory:x:1002:1002::/home/mallory:/bin/sh\n"), 0o644))
	for _, u := range []struct {
		name string
		id   int
	}{{"alice", 1000}, {"bob", 1001}, {"mallory", 1002}} {
		must(os.MkdirAll(filepath.Join(root, "home", u.name), 0o755))
		must(os.Chown(filepath.Join(root, "home", u.name), u.id, u.id))
	}
	kw := &keyWriter{root: root, given: filepath.Join(t.TempDir(), "given")}
	const k1, k2, own = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOne one@imp", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITwo two@imp", "ssh-rsa AAAAB3Nza own@alice"
	ak := filepath.Join(root, "home/alice/.ssh/authorized_keys")
	read := func() string {
		b, err := os.ReadFile(ak)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}

	pending, err := kw.give(guestsession.AuthorizedKeys{"alice": {k1}, "carol": {k2}})
	if err != nil || !slices.Equal(pending, []string{"carol"}) {
		t.Fatalf("first write: pending %v, %v; want carol pending", pending, err)
	}
	if got := read(); !strings.Contains(got, k1) {
		t.Fatalf("alice's authorized_keys: %q", got)
	}
	for path, want := range map[string]os.FileMode{filepath.Dir(ak): os.ModeDir | 0o700, ak: 0o600} {
		st, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if sys := st.Sys().(*syscall.Stat_t); st.Mode() != want || sys.Uid != 1000 || sys.Gid != 1000 {
			t.Errorf("%s: %v %d:%d, want %v 1000:1000", path, st.Mode(), sys.Uid, sys.Gid, want)
		}
	}
	// The user's own line stays; the rotated key replaces the old.
	must(os.WriteFile(ak, []byte(own+"\n"+read()), 0o600))
	if _, err := kw.give(guestsession.AuthorizedKeys{"alice": {k2}}); err != nil {
		t.Fatal(err)
	}
	if got := read(); !strings.Contains(got, own+"\n") || strings.Contains(got, k1) || !strings.Contains(got, k2) || strings.Count(got, keysBegin) != 1 {
		t.Errorf("after the rotation, alice's authorized_keys: %q", got)
	}
	// Taken out of the VM's credentials, after a restart of the guest side (a new writer on
	// the same record): its block is emptied, its own line stays.
	kw = &keyWriter{root: root, given: kw.given}
	if _, err := kw.give(guestsession.AuthorizedKeys{}); err != nil {
		t.Fatal(err)
	}
	if got := read(); got != own+"\n" {
		t.Errorf("after alice was taken out, her authorized_keys: %q, want only her own line", got)
	}

	// bob's ~/.ssh a symlink to a directory of root's: refused, nothing written there.
	victim := filepath.Join(root, "victim")
	must(os.MkdirAll(victim, 0o755))
	must(os.WriteFile(filepath.Join(victim, "authorized_keys"), []byte("root's own\n"), 0o600))
	must(os.Symlink(victim, filepath.Join(root, "home/bob/.ssh")))
	if _, err := kw.give(guestsession.AuthorizedKeys{"bob": {k1}}); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("bob's ~/.ssh a symlink: %v, want a refusal", err)
	}
	// mallory's authorized_keys a symlink to a file of root's, then a FIFO.
	must(os.MkdirAll(filepath.Join(root, "home/mallory/.ssh"), 0o700))
	must(os.Chown(filepath.Join(root, "home/mallory/.ssh"), 1002, 1002))
	must(os.Symlink(filepath.Join(victim, "authorized_keys"), filepath.Join(root, "home/mallory/.ssh/authorized_keys")))
	if _, err := kw.give(guestsession.AuthorizedKeys{"mallory": {k1}}); err == nil || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("mallory's authorized_keys a symlink: %v, want a refusal", err)
	}
	must(os.Remove(filepath.Join(root, "home/mallory/.ssh/authorized_keys")))
	must(unix.Mkfifo(filepath.Join(root, "home/mallory/.ssh/authorized_keys"), 0o600))
	if _, err := kw.give(guestsession.AuthorizedKeys{"mallory": {k1}}); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("mallory's authorized_keys a FIFO: %v, want a refusal", err)
	}
	// A hard link to a file of root's (where protected_hardlinks is off): neither read nor
	// written through.
	must(os.Remove(filepath.Join(root, "home/mallory/.ssh/authorized_keys")))
	must(os.Link(filepath.Join(victim, "authorized_keys"), filepath.Join(root, "home/mallory/.ssh/authorized_keys")))
	if _, err := kw.give(guestsession.AuthorizedKeys{"mallory": {k1}}); err == nil || !strings.Contains(err.Error(), "hard link") {
		t.Errorf("mallory's authorized_keys a hard link to root's file: %v, want a refusal", err)
	}
	// A ~/.ssh of another user's (mallory made bob's): refused.
	must(os.Remove(filepath.Join(root, "home/bob/.ssh")))
	must(os.Mkdir(filepath.Join(root, "home/bob/.ssh"), 0o700))
	must(os.Chown(filepath.Join(root, "home/bob/.ssh"), 1002, 1002))
	if _, err := kw.give(guestsession.AuthorizedKeys{"bob": {k1}}); err == nil || !strings.Contains(err.Error(), "belongs to uid 1002") {
		t.Errorf("bob's ~/.ssh mallory's: %v, want a refusal", err)
	}
	if _, err := os.Stat(filepath.Join(root, "home/bob/.ssh/authorized_keys")); !os.IsNotExist(err) {
		t.Errorf("a file was written in bob's ~/.ssh of mallory's: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(victim, "authorized_keys")); string(b) != "root's own\n" {
		t.Errorf("the file the symlinks named was changed: %q", b)
	}
	if ents, _ := os.ReadDir(victim); len(ents) != 1 {
		t.Errorf("the directory bob's symlink named holds %d entries, want only its own", len(ents))
	}
	// A key line that would be two lines, or a comment that would end IMP's block; a user's
	// name that is a path.
	for _, bad := range []string{k1 + "\n" + k2, keysEnd} {
		if _, err := kw.give(guestsession.AuthorizedKeys{"alice": {bad}}); err == nil {
			t.Errorf("the key line %q was written", bad)
		}
	}
	if _, err := kw.give(guestsession.AuthorizedKeys{"../root": {k1}}); err == nil || !strings.Contains(err.Error(), "not a user name") {
		t.Errorf("the user ../root: %v, want a refusal", err)
	}
	if got := read(); got != own+"\n" {
		t.Errorf("after the refused lines, alice's authorized_keys: %q", got)
	}
}

func TestWithBlock(t *testing.T) {
	block := keysBegin + "\nk\n" + keysEnd + "\n"
	for _, c := range []struct{ old, want string }{
		{"", block},
		{"a", "a\n" + block},
		{"a\n" + block + "b\n", "a\nb\n" + block},
		{"a\n" + keysBegin + "\nstale\n", "a\n" + block}, // an end marker lost: the rest was IMP's
	} {
		if got := string(withBlock([]byte(c.old), []string{"k"})); got != c.want {
			t.Errorf("withBlock(%q) = %q, want %q", c.old, got, c.want)
		}
	}
}
