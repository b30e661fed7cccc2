package disk

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
)

type entry struct {
	name, link string
	typ        byte
	mode       int64
	body       string
	uid        int
}

func file(name, body string) entry {
	return entry{name: name, typ: tar.TypeReg, mode: 0o644, body: body}
}
func dir(name string, mode int64) entry { return entry{name: name, typ: tar.TypeDir, mode: mode} }
func symlink(name, target string) entry {
	return entry{name: name, typ: tar.TypeSymlink, link: target, mode: 0o777}
}
func hardlink(name, target string) entry {
	return entry{name: name, typ: tar.TypeLink, link: target, mode: 0o644}
}
func device(name string, typ byte) entry { return entry{name: name, typ: typ, mode: 0o600} }
func modeFile(name string, mode int64) entry {
	return entry{name: name, typ: tar.TypeReg, mode: mode, body: "x"}
}

func tarOf(t testing.TB, entries ...entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: e.mode, Size: int64(len(e.body)), Uid: e.uid, Gid: e.uid}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			if _, err := tw.Write([]byte(e.body)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// sandbox makes parent/root (the extraction root) beside parent/outside (what must not change)
// and returns the root and a function that describes everything outside the root.
func sandbox(t testing.TB) (string, func() string) {
	parent := t.TempDir()
	root := filepath.Join(parent, "root")
	outside := filepath.Join(parent, "outside")
	for _, d := range []string{root, outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("host data"), 0o600); err != nil {
		t.Fatal(err)
	}
	return root, func() string {
		var lines []string
		_ = filepath.WalkDir(parent, func(p string, d fs.DirEntry, err error) error {
			if err != nil || p == root {
				if p == root {
					return filepath.SkipDir
				}
				return err
			}
			fi, _ := os.Lstat(p)
			st := fi.Sys().(*syscall.Stat_t)
			data, _ := os.ReadFile(p)
			lines = append(lines, fmt.Sprintf("%s %v %d links=%d %q", p, fi.Mode(), fi.Size(), st.Nlink, data))
			return nil
		})
		sort.Strings(lines)
		return strings.Join(lines, "\n")
	}
}

func TestApplyLayerRefusesEscapes(t *testing.T) {
	tests := []struct {
		name    string
		entries func(outside string) []entry
	}{
		{name: "dot-dot name", entries: func(string) []entry { return []entry{file("../outside/pwned", "x")} }},
		{name: "dot-dot inside a name", entries: func(string) []entry { return []entry{dir("a", 0o755), file("a/../../outside/pwned", "x")} }},
		{name: "absolute name", entries: func(o string) []entry { return []entry{file(filepath.Join(o, "pwned"), "x")} }},
		{name: "write through an absolute symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", o), file("evil/pwned", "x")}
		}},
		{name: "overwrite through an absolute symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", filepath.Join(o, "secret")), file("evil", "x"), dir("d", 0o755), symlink("d/s", o), file("d/s/secret", "overwritten")}
		}},
		{name: "write through a relative symlink", entries: func(string) []entry {
			return []entry{symlink("up", "../outside"), file("up/pwned", "x")}
		}},
		{name: "hard link to a host path", entries: func(o string) []entry { return []entry{hardlink("h", filepath.Join(o, "secret"))} }},
		{name: "hard link climbing out", entries: func(string) []entry { return []entry{hardlink("h", "../outside/secret")} }},
		{name: "hard link through a symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", o), hardlink("h", "evil/secret")}
		}},
		{name: "directory through a symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", o), dir("evil/newdir", 0o755)}
		}},
		{name: "whiteout through a symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", o), file("evil/.wh.secret", "")}
		}},
		{name: "opaque directory through a symlink", entries: func(o string) []entry {
			return []entry{symlink("evil", o), file("evil/.wh..wh..opq", "")}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root, outsideState := sandbox(t)
			before := outsideState()
			outside := filepath.Join(filepath.Dir(root), "outside")
			budget := Budget{Bytes: 1 << 20, Entries: DefaultMaxEntries}
			_, err := ApplyLayer(bytes.NewReader(tarOf(t, tt.entries(outside)...)), root, &budget)
			if !errors.Is(err, ErrUnsafeLayer) {
				t.Errorf("error = %v, want ErrUnsafeLayer", err)
			}
			if after := outsideState(); after != before {
				t.Errorf("outside the root changed:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			t.Logf("refused: %v", err)
		})
	}
}

func TestApplyLayerFilesystem(t *testing.T) {
	root, _ := sandbox(t)
	data := tarOf(t,
		dir("./", 0o755),
		dir("bin", 0o755),
		hardlink("bin/app2", "bin/app"), // its target comes later in the layer
		file("bin/app", "v1"),
		modeFile("bin/su", 0o4755),
		file("usr/share/deep/file", "no parent entries"),
		symlink("etc/localtime", "/usr/share/zoneinfo/UTC"), // absolute: fine as long as nothing goes through it
		symlink("sbin", "bin"),
		device("dev/null", tar.TypeChar),
		device("dev/fifo", tar.TypeFifo),
		dir("ro", 0o555),
		entry{name: "home/app", typ: tar.TypeDir, mode: 0o750, uid: 1000},
		file("ro/inside", "written before ro's mode is applied"),
	)
	budget := Budget{Bytes: 1 << 20, Entries: DefaultMaxEntries}
	rep, err := ApplyLayer(bytes.NewReader(data), root, &budget)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Files != 4 || rep.Symlinks != 2 || rep.Hardlinks != 1 || rep.SkippedDevices != 2 {
		t.Errorf("report = %+v", rep)
	}
	read := func(p string) string { b, _ := os.ReadFile(filepath.Join(root, p)); return string(b) }
	if read("bin/app") != "v1" || read("bin/app2") != "v1" || read("usr/share/deep/file") != "no parent entries" {
		t.Errorf("contents: app=%q app2=%q deep=%q", read("bin/app"), read("bin/app2"), read("usr/share/deep/file"))
	}
	if fi, _ := os.Stat(filepath.Join(root, "bin/su")); fi.Mode()&fs.ModeSetuid == 0 {
		t.Errorf("setuid bit lost: %v", fi.Mode())
	}
	if fi, _ := os.Stat(filepath.Join(root, "ro")); fi.Mode().Perm() != 0o555 {
		t.Errorf("ro mode %v", fi.Mode())
	}
	if fi, _ := os.Stat(filepath.Join(root, "home/app")); os.Geteuid() == 0 && fi.Sys().(*syscall.Stat_t).Uid != 1000 {
		t.Errorf("directory owner %d, want 1000", fi.Sys().(*syscall.Stat_t).Uid)
	}
	if l, _ := os.Readlink(filepath.Join(root, "etc/localtime")); l != "/usr/share/zoneinfo/UTC" {
		t.Errorf("symlink target %q", l)
	}
	if _, err := os.Lstat(filepath.Join(root, "dev/null")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a device node was created: %v", err)
	}
}

// TestLayersStack applies layers bottom first: replacement, whiteouts, opaque directories.
func TestLayersStack(t *testing.T) {
	root, _ := sandbox(t)
	budget := Budget{Bytes: 1 << 20, Entries: DefaultMaxEntries}
	for i, l := range [][]entry{
		{dir("etc", 0o755), file("etc/a", "1"), file("etc/b", "1"), dir("opt", 0o755), file("opt/x", "1"), dir("d", 0o755), file("d/f", "1"), file("link", "1")},
		{file("etc/a", "2"), file("etc/.wh.b", ""), file("opt/.wh..wh..opq", ""), file("opt/y", "2"), file("d", "a file now"), dir("link", 0o755)},
	} {
		if _, err := ApplyLayer(bytes.NewReader(tarOf(t, l...)), root, &budget); err != nil {
			t.Fatalf("layer %d: %v", i, err)
		}
	}
	read := func(p string) string { b, _ := os.ReadFile(filepath.Join(root, p)); return string(b) }
	gone := func(p string) bool { _, err := os.Lstat(filepath.Join(root, p)); return errors.Is(err, fs.ErrNotExist) }
	switch {
	case read("etc/a") != "2":
		t.Error("a file was not replaced")
	case !gone("etc/b"):
		t.Error("a whiteout did not remove its file")
	case !gone("opt/x") || read("opt/y") != "2":
		t.Error("an opaque directory kept a lower layer's file or lost its own")
	case read("d") != "a file now":
		t.Error("a file did not replace a directory")
	}
	if fi, err := os.Lstat(filepath.Join(root, "link")); err != nil || !fi.IsDir() {
		t.Error("a directory did not replace a file")
	}
}

func TestExtractLimit(t *testing.T) {
	for _, tt := range []struct {
		name   string
		budget Budget
		want   error
	}{
		{"bytes", Budget{Bytes: 8, Entries: 100}, ErrTooLarge},
		{"entries", Budget{Bytes: 100, Entries: 1}, ErrTooLarge},
		{"within both", Budget{Bytes: 10, Entries: 2}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			root, _ := sandbox(t)
			b := tt.budget
			_, err := ApplyLayer(bytes.NewReader(tarOf(t, file("a", "12345"), file("b", "67890"))), root, &b)
			if !errors.Is(err, tt.want) {
				t.Errorf("error = %v, want %v", err, tt.want)
			}
		})
	}
}

// FuzzApplyLayer: whatever the tar, nothing outside the root changes and nothing panics.
func FuzzApplyLayer(f *testing.F) {
	f.Add(tarOf(f, symlink("evil", "/tmp"), file("evil/x", "x")))
	f.Add(tarOf(f, symlink("up", "../outside"), file("up/secret", "x"), hardlink("h", "up/secret")))
	f.Add(tarOf(f, dir("a", 0o755), file("a/../../outside/secret", "x")))
	f.Add(tarOf(f, file("ok", "fine"), hardlink("l", "ok"), symlink("s", "l")))
	f.Fuzz(func(t *testing.T, data []byte) {
		root, outsideState := sandbox(t)
		before := outsideState()
		budget := Budget{Bytes: 1 << 16, Entries: DefaultMaxEntries}
		_, _ = ApplyLayer(bytes.NewReader(data), root, &budget)
		if after := outsideState(); after != before {
			t.Fatalf("outside the root changed:\nbefore:\n%s\nafter:\n%s", before, after)
		}
	})
}
