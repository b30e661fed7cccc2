package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/syscode-labs/imp/internal/guestinit"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"
)

// Writables makes VMs' writable disks: empty ext4 file systems labelled
// guestinit.WritableLabel, where imp-init keeps the overlay's upper layer. The file system of
// each size is made once, by mkfs, as a template in Dir; a VM's disk is a copy of it, a reflink
// where the file system allows, else a sparse copy of the little the template holds — no mkfs
// per VM. At most Keep templates (8 when 0) stay, the least recently used going first: sizes
// are the tenants' choice.
type Writables struct {
	Dir  string
	Mkfs string // mkfs.ext4 to run (default: from PATH)
	Keep int

	builds singleflight.Group
	mu     sync.Mutex
	used   map[string]time.Time // template → last use
}

// Ensure creates the writable disk of size bytes at path when it does not exist. An existing
// disk is left as it is: it holds what the VM wrote.
func (w *Writables) Ensure(path string, size int64) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	work, err := os.MkdirTemp(filepath.Dir(path), ".writable-")
	if err != nil {
		return fmt.Errorf("creating a build directory: %w", err)
	}
	defer os.RemoveAll(work)
	tmp := filepath.Join(work, "disk.ext4")
	for try := 0; ; try++ {
		tmpl, err := w.template(max(size>>20, 16))
		if err != nil {
			return err
		}
		// A template evicted between its lookup and its copy is made again, once.
		if err = cloneFile(tmpl, tmp); errors.Is(err, fs.ErrNotExist) && try == 0 {
			continue
		} else if err != nil {
			return fmt.Errorf("copying the writable disk's template: %w", err)
		}
		break
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// template returns the template of mib MiB, making it when missing.
func (w *Writables) template(mib int64) (string, error) {
	p := filepath.Join(w.Dir, fmt.Sprintf("writable-%dM.ext4", mib))
	_, err, _ := w.builds.Do(p, func() (any, error) {
		if _, err := os.Stat(p); err == nil {
			return nil, nil
		}
		if err := os.MkdirAll(w.Dir, 0o700); err != nil {
			return nil, err
		}
		mkfs := w.Mkfs
		if mkfs == "" {
			mkfs = "mkfs.ext4"
		}
		tmp := p + ".tmp"
		_ = os.Remove(tmp)
		// The file is new, so it reads as zeros: mkfs need not zero the journal and inode
		// tables, which it otherwise allocates (33 MB of a 1 GiB file system, 1 GB of a 1 TiB
		// one; unwritten extents, which the VMs' sparse copies skip, but the templates' space).
		out, err := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-E", "lazy_itable_init=1,lazy_journal_init=1",
			"-L", guestinit.WritableLabel, tmp, fmt.Sprintf("%dM", mib)).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("building the writable disk template: %w: %s", err, out)
		}
		if err := syncFile(tmp); err != nil {
			return nil, err
		}
		return nil, os.Rename(tmp, p)
	})
	if err != nil {
		return "", err
	}
	w.touch(p)
	return p, nil
}

// touch records a use of template p and removes the least recently used beyond Keep.
func (w *Writables) touch(p string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.used == nil {
		w.used = map[string]time.Time{}
	}
	w.used[p] = time.Now()
	keep := w.Keep
	if keep == 0 {
		keep = 8
	}
	for len(w.used) > keep {
		oldest := p
		for q, t := range w.used {
			if t.Before(w.used[oldest]) {
				oldest = q
			}
		}
		_ = os.Remove(oldest) // a copy under way keeps its open file
		delete(w.used, oldest)
	}
}

// cloneFile copies src to a new file dst: a reflink (FICLONE) where the file system shares
// blocks, else the data regions of src, leaving its holes holes.
func cloneFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer out.Close()
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return out.Close()
	}
	st, err := in.Stat()
	if err != nil {
		return err
	}
	if err := out.Truncate(st.Size()); err != nil {
		return err
	}
	for off := int64(0); off < st.Size(); {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		} else if err != nil {
			return err
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return err
		}
		for r, w := data, data; r < hole; {
			n, err := unix.CopyFileRange(int(in.Fd()), &r, int(out.Fd()), &w, int(hole-r), 0)
			if err != nil {
				return err
			}
			if n == 0 {
				return fmt.Errorf("%s ended while copying it", src)
			}
		}
		off = hole
	}
	return out.Close()
}

// WriteConfig writes the configuration disk of one run (guestinit.EncodeConfigDisk) to path,
// readable by its owner only; it replaces the previous run's.
func WriteConfig(path string, cfg guestinit.Config) error {
	data, err := guestinit.EncodeConfigDisk(cfg)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return fmt.Errorf("writing the configuration disk: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("installing the configuration disk: %w", err)
	}
	return nil
}
