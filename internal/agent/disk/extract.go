// Package disk turns OCI images into the disks IMP boots guests from: one read-only ext4 base
// disk per image digest, shared by every VM of that image, built from the image's flattened
// layers by a safe extractor.
package disk

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strings"
	"time"
)

// ErrUnsafeLayer is returned for a layer entry that would reach outside the extraction root:
// an absolute or ".." name, a write through a symlink that leaves the root, a hard link to an
// absolute or escaping path.
var ErrUnsafeLayer = errors.New("disk: unsafe layer entry")

// ErrTooLarge is returned when an image's files exceed the extraction limit.
var ErrTooLarge = errors.New("disk: image larger than the limit")

// Budget bounds what an image puts on the node as it is extracted; ApplyLayer lowers it.
type Budget struct {
	// Bytes of file data still allowed.
	Bytes int64
	// Entries still allowed: files, directories, links and whiteouts, each an inode or a
	// removal — millions of empty files exhaust a node's inodes, not its bytes.
	Entries int64
	// build, when set, is charged what is written as it is written, a block per entry and
	// every file's bytes: the node's builds are bounded together (BuildLimits).
	build *admission
}

// entryBytes is what an entry is charged beside its data: an inode and a block.
const entryBytes = 4096

// ExtractReport counts what an extraction wrote and skipped.
type ExtractReport struct {
	Files, Dirs, Symlinks, Hardlinks int
	// SkippedDevices counts character and block devices and FIFOs, which are never created on
	// the host: imp-init mounts devtmpfs in the guest.
	SkippedDevices int
	// Whiteouts counts removals by whiteout entries.
	Whiteouts int
	Bytes     int64
}

// Whiteout names of the OCI image layer format.
const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
)

// ApplyLayer applies one image layer (an uncompressed tar) onto dir, the root filesystem built
// from the layers below it: entries replace what is at their path (a file replaces a directory
// and the other way round), ".wh.<name>" removes name, ".wh..wh..opq" empties its directory of
// what lower layers put there. Apply an image's layers bottom first into an empty directory.
//
// Every file operation goes through an os.Root of dir, so nothing outside dir can be created,
// changed or followed, whatever the layer holds; entries that try (an absolute or ".." name, a
// write through a symlink leaving the root, a hard link to an absolute or escaping path) are
// refused with ErrUnsafeLayer and the application stops.
//
// Modes are kept, setuid and setgid bits included (they matter inside the guest only; keep dir
// private to root), and so are owners when running as root. Device nodes and FIFOs are not
// created. Past budget, in bytes or entries, it stops with ErrTooLarge.
func ApplyLayer(r io.Reader, dir string, budget *Budget) (ExtractReport, error) {
	var rep ExtractReport
	root, err := os.OpenRoot(dir)
	if err != nil {
		return rep, fmt.Errorf("opening extraction root %s: %w", dir, err)
	}
	defer root.Close()

	type dirMeta struct {
		name     string
		mode     fs.FileMode
		mtime    time.Time
		uid, gid int
	}
	var dirs []dirMeta
	var links [][2]string        // target, name: made last, their targets may come later
	written := map[string]bool{} // paths this layer wrote, which an opaque marker keeps
	var opaque []string          // directories this layer makes opaque
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return rep, fmt.Errorf("reading layer: %w", err)
		}
		if budget.Entries <= 0 {
			return rep, fmt.Errorf("%w: more entries than allowed, at %s", ErrTooLarge, hdr.Name)
		}
		budget.Entries--
		if budget.build != nil {
			if err := budget.build.charge(entryBytes); err != nil {
				return rep, fmt.Errorf("at %s: %w", hdr.Name, err)
			}
		}
		name, err := entryName(hdr.Name)
		if err != nil {
			return rep, err
		}
		base, parent := path.Base(name), path.Dir(name)
		switch {
		case base == opaqueMarker:
			opaque = append(opaque, parent)
			continue
		case strings.HasPrefix(base, whiteoutPrefix):
			victim := path.Join(parent, strings.TrimPrefix(base, whiteoutPrefix))
			if err := root.RemoveAll(victim); err != nil {
				return rep, unsafeOr(err, "applying whiteout %s", hdr.Name)
			}
			rep.Whiteouts++
			continue
		case name == ".":
			if hdr.Typeflag == tar.TypeDir {
				dirs = append(dirs, dirMeta{".", hdr.FileInfo().Mode(), hdr.ModTime, hdr.Uid, hdr.Gid})
			}
			continue
		}
		if parent != "." {
			// The directories an entry's path makes are entries too: counted and charged, so
			// that one entry named a/a/a/.../f makes no more directories than the budget allows.
			if made := missingDirs(root, parent); made > 0 {
				if budget.Entries < int64(made) {
					return rep, fmt.Errorf("%w: more entries than allowed, at %s", ErrTooLarge, hdr.Name)
				}
				budget.Entries -= int64(made)
				if budget.build != nil {
					if err := budget.build.charge(int64(made) * entryBytes); err != nil {
						return rep, fmt.Errorf("at %s: %w", hdr.Name, err)
					}
				}
			}
			if err := root.MkdirAll(parent, 0o755); err != nil {
				return rep, unsafeOr(err, "creating parent of %s", hdr.Name)
			}
		}
		if hdr.Typeflag != tar.TypeLink {
			if err := clear(root, name, hdr.Typeflag == tar.TypeDir); err != nil {
				return rep, unsafeOr(err, "replacing %s", hdr.Name)
			}
		}
		written[name] = true
		mode := hdr.FileInfo().Mode()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.Mkdir(name, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
				return rep, unsafeOr(err, "creating directory %s", hdr.Name)
			}
			dirs = append(dirs, dirMeta{name, mode, hdr.ModTime, hdr.Uid, hdr.Gid})
			rep.Dirs++
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // old tars still use TypeRegA
			if hdr.Size > budget.Bytes {
				return rep, fmt.Errorf("%w: at %s", ErrTooLarge, hdr.Name)
			}
			f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return rep, unsafeOr(err, "creating %s", hdr.Name)
			}
			var w io.Writer = f
			if budget.build != nil {
				w = chargingWriter{w: f, a: budget.build}
			}
			n, err := io.Copy(w, io.LimitReader(tr, hdr.Size))
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return rep, fmt.Errorf("writing %s: %w", hdr.Name, err)
			}
			budget.Bytes -= n
			rep.Bytes += n
			if err := setMeta(root, name, mode, hdr); err != nil {
				return rep, err
			}
			rep.Files++
		case tar.TypeSymlink:
			// A symlink may point anywhere: the root refuses to follow it out of dir later.
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return rep, unsafeOr(err, "creating symlink %s", hdr.Name)
			}
			lchown(root, name, hdr)
			rep.Symlinks++
		case tar.TypeLink:
			target, err := entryName(hdr.Linkname)
			if err != nil {
				return rep, fmt.Errorf("%w: hard link %s to %q", ErrUnsafeLayer, hdr.Name, hdr.Linkname)
			}
			links = append(links, [2]string{target, name})
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			rep.SkippedDevices++
		default:
			// PAX and GNU metadata entries are consumed by the reader; anything else (sparse
			// or vendor types) carries nothing a root filesystem needs.
		}
	}
	for _, d := range opaque {
		if err := emptyExcept(root, d, written); err != nil {
			return rep, unsafeOr(err, "making %s opaque", d)
		}
	}
	for _, l := range links {
		if err := clear(root, l[1], false); err != nil {
			return rep, unsafeOr(err, "replacing %s", l[1])
		}
		if err := root.Link(l[0], l[1]); err != nil {
			return rep, unsafeOr(err, "linking %s to %s", l[1], l[0])
		}
		rep.Hardlinks++
	}
	// Directory modes and times last, deepest first: a read-only directory must not stop its
	// children from being written, and writing children changes a directory's mtime.
	slices.SortFunc(dirs, func(a, b dirMeta) int { return strings.Count(b.name, "/") - strings.Count(a.name, "/") })
	for _, d := range dirs {
		if os.Geteuid() == 0 {
			_ = root.Lchown(d.name, d.uid, d.gid)
		}
		if err := root.Chmod(d.name, d.mode&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
			return rep, unsafeOr(err, "setting the mode of %s", d.name)
		}
		_ = root.Chtimes(d.name, d.mtime, d.mtime)
	}
	return rep, nil
}

// clear makes room for an entry at name: it removes what a lower layer left there, except a
// directory where a directory is coming (they merge). It never follows a symlink at name.
func clear(root *os.Root, name string, isDir bool) error {
	fi, err := root.Lstat(name)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case err != nil:
		return err
	case isDir && fi.IsDir():
		return nil
	}
	return root.RemoveAll(name)
}

// emptyExcept removes the entries of dir that this layer did not write.
func emptyExcept(root *os.Root, dir string, keep map[string]bool) error {
	f, err := root.Open(dir)
	if err != nil {
		return err
	}
	names, err := f.Readdirnames(-1)
	f.Close()
	if err != nil {
		return err
	}
	for _, n := range names {
		p := path.Join(dir, n)
		if !keep[p] && !hasKept(p, keep) {
			if err := root.RemoveAll(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// hasKept reports whether this layer wrote anything under p.
func hasKept(p string, keep map[string]bool) bool {
	for k := range keep {
		if strings.HasPrefix(k, p+"/") {
			return true
		}
	}
	return false
}

// entryName cleans a tar entry name to a path relative to the root, refusing absolute names
// and names that climb out of it.
func entryName(name string) (string, error) {
	if name == "" || path.IsAbs(name) || strings.ContainsRune(name, 0) {
		return "", fmt.Errorf("%w: name %q", ErrUnsafeLayer, name)
	}
	clean := path.Clean(name)
	if clean == ".." || strings.HasPrefix(clean, "../") {
		return "", fmt.Errorf("%w: name %q leaves the root", ErrUnsafeLayer, name)
	}
	// No file system of a guest holds longer paths (PATH_MAX), nor deeper ones worth the
	// directories they make.
	if len(clean) > maxPath || strings.Count(clean, "/") >= maxDepth {
		return "", fmt.Errorf("%w: a name of %d bytes and %d components, past %d and %d", ErrTooLarge, len(clean), strings.Count(clean, "/")+1, maxPath, maxDepth)
	}
	return clean, nil
}

// maxPath and maxDepth bound an entry's name: PATH_MAX, and far deeper than real images go.
const (
	maxPath  = 4096
	maxDepth = 256
)

// missingDirs counts the directories of dir (a clean relative path) that root lacks: those
// MkdirAll would make.
func missingDirs(root *os.Root, dir string) int {
	n := 0
	for d := dir; d != "." && d != "/"; d = path.Dir(d) {
		if _, err := root.Lstat(d); err == nil {
			break
		}
		n++
	}
	return n
}

func setMeta(root *os.Root, name string, mode fs.FileMode, hdr *tar.Header) error {
	lchown(root, name, hdr)
	// After chown: chown clears setuid and setgid bits.
	if err := root.Chmod(name, mode&(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky)); err != nil {
		return unsafeOr(err, "setting the mode of %s", hdr.Name)
	}
	_ = root.Chtimes(name, hdr.ModTime, hdr.ModTime)
	return nil
}

// lchown gives name the entry's owner when the process may (root); otherwise the files stay
// the extracting user's.
func lchown(root *os.Root, name string, hdr *tar.Header) {
	if os.Geteuid() == 0 {
		_ = root.Lchown(name, hdr.Uid, hdr.Gid)
	}
}

// unsafeOr reports an os.Root refusal (the path escapes the root) as ErrUnsafeLayer and wraps
// any other error with what was being done.
func unsafeOr(err error, format string, args ...any) error {
	what := fmt.Sprintf(format, args...)
	// os.Root's refusals all carry this text (its sentinel is unexported).
	if strings.Contains(err.Error(), "path escapes from parent") {
		return fmt.Errorf("%w: %s: %v", ErrUnsafeLayer, what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}
