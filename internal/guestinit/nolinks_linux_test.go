package guestinit

import (
	"os"
	"path/filepath"
	"testing"
)

// TestNoLinks: a mount added to a guest whose workload has run refuses a path through a
// symbolic link the workload could have left, and takes one whose parts are directories or
// do not exist yet.
func TestNoLinks(t *testing.T) {
	dir := t.TempDir()
	if err := os.Symlink("/etc", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "real"), 0o755); err != nil {
		t.Fatal(err)
	}
	for p, ok := range map[string]bool{
		filepath.Join(dir, "link", "creds"): false,
		filepath.Join(dir, "link"):          false,
		filepath.Join(dir, "real", "creds"): true,
		filepath.Join(dir, "new", "creds"):  true,
		"relative/path":                     false,
	} {
		if err := noLinks(p); (err == nil) != ok {
			t.Errorf("%s: %v", p, err)
		}
	}
}
