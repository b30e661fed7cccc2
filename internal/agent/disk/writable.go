package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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
// per VM. Spares copies of each template are kept ready, copied and synced off the starts'
// path, so that a start takes one by a rename. At most Keep templates (8 when 0) stay, with
// their spares, the least recently used going first: sizes are the tenants' choice.
type Writables struct {
	Dir  string
	Mkfs string // mkfs.ext4 to run (default: from PATH)
	Keep int
	// Spares is how many copies of each template are kept ready: 4 when 0, none when negative.
	Spares int

	builds    singleflight.Group
	mu        sync.Mutex
	used      map[string]time.Time // template → last use
	refilling map[string]bool      // template → its spares are being made; true: look again after
	refills   sync.WaitGroup
	stopped   bool // Stop was called: no refill begins
}

// Ensure creates the writable disk of size bytes at path when it does not exist. An existing
// disk is left as it is: it holds what the VM wrote.
func (w *Writables) Ensure(path string, size int64) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	mib := max(size>>20, 16)
	tmpl, err := w.template(mib)
	if err != nil {
		return err
	}
	if w.takeSpare(tmpl, path) {
		w.refill(tmpl)
		return nil
	}
	work, err := os.MkdirTemp(filepath.Dir(path), ".writable-")
	if err != nil {
		return fmt.Errorf("creating a build directory: %w", err)
	}
	defer os.RemoveAll(work)
	tmp := filepath.Join(work, "disk.ext4")
	err = cloneFile(tmpl, tmp)
	if errors.Is(err, fs.ErrNotExist) {
		// A template evicted between its lookup and its copy is made again, once.
		if tmpl, err = w.template(mib); err != nil {
			return err
		}
		err = cloneFile(tmpl, tmp)
	}
	if err != nil {
		return fmt.Errorf("copying the writable disk's template: %w", err)
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	w.refill(tmpl)
	return nil
}

// spareSuffix marks a spare copy of a template: "<template>.spare-<random>", with ".tmp"
// until it is synced.
const spareSuffix = ".spare-"

// takeSpare renames a spare copy of tmpl to path; false when there is none (or path is on
// another file system).
func (w *Writables) takeSpare(tmpl, path string) bool {
	spares, _ := filepath.Glob(tmpl + spareSuffix + "*")
	for _, s := range spares {
		if !strings.HasSuffix(s, ".tmp") && os.Rename(s, path) == nil {
			return true
		}
	}
	return false
}

// refill makes spare copies of tmpl, in the background, until Spares are ready.
func (w *Writables) refill(tmpl string) {
	want := w.Spares
	if want == 0 {
		want = 4
	}
	if want < 0 {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	if w.refilling == nil {
		w.refilling = map[string]bool{}
	}
	if _, running := w.refilling[tmpl]; running {
		w.refilling[tmpl] = true // a spare was taken since it counted: it counts again
		return
	}
	w.refilling[tmpl] = false
	w.refills.Add(1)
	go func() {
		defer w.refills.Done()
		for {
			w.fillSpares(tmpl, want)
			w.mu.Lock()
			again := w.refilling[tmpl]
			if !again {
				delete(w.refilling, tmpl)
				w.mu.Unlock()
				return
			}
			w.refilling[tmpl] = false
			w.mu.Unlock()
		}
	}()
}

// fillSpares copies tmpl until want spares are ready; a template evicted meanwhile ends it.
func (w *Writables) fillSpares(tmpl string, want int) {
	spares, _ := filepath.Glob(tmpl + spareSuffix + "*")
	ready := 0
	for _, s := range spares {
		if strings.HasSuffix(s, ".tmp") {
			_ = os.Remove(s) // an earlier agent's, cut short: only one refill runs per template
		} else {
			ready++
		}
	}
	for ; ready < want; ready++ {
		tmp := fmt.Sprintf("%s%s%016x.tmp", tmpl, spareSuffix, rand.Uint64())
		err := cloneFile(tmpl, tmp)
		if err == nil {
			err = syncFile(tmp)
		}
		if err == nil {
			// Under the lock eviction takes: a template evicted meanwhile keeps no spare.
			w.mu.Lock()
			if _, kept := w.used[tmpl]; kept {
				err = os.Rename(tmp, strings.TrimSuffix(tmp, ".tmp"))
			} else {
				err = fs.ErrNotExist
			}
			w.mu.Unlock()
		}
		if err != nil {
			_ = os.Remove(tmp)
			return // the next start copies, and refills again
		}
	}
}

// Wait waits for the spares being made.
func (w *Writables) Wait() { w.refills.Wait() }

// Stop waits for the spares being made, and begins none after: the agent is stopping.
func (w *Writables) Stop() {
	w.mu.Lock()
	w.stopped = true // refills begin under the lock: none is added to refills while it waits
	w.mu.Unlock()
	w.refills.Wait()
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
		spares, _ := filepath.Glob(oldest + spareSuffix + "*")
		for _, s := range spares {
			_ = os.Remove(s)
		}
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
