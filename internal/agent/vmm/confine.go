package vmm

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// OpenIn opens name inside dir for the agent, which runs as root, in a place a VMM can write
// to (a jail, a VM's directory): never through a symbolic link — none out of dir (os.Root),
// none at all at the last component (O_NOFOLLOW) — and only a regular file with one link, so a
// file a compromised VMM swapped for a link to a host file or a shared disk is refused.
func OpenIn(dir, name string, flag int) (*os.File, error) {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	f, err := root.OpenFile(name, flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || !fi.Mode().IsRegular() || st.Nlink != 1 {
		f.Close()
		return nil, fmt.Errorf("refusing %s in %s: not a regular file of its own (mode %s)", name, dir, fi.Mode())
	}
	return f, nil
}

// Tail returns up to n bytes of the end of the file name in dir, on one line ("" when it
// cannot be read: missing, or refused by OpenIn).
func Tail(dir, name string, n int64) string {
	f, err := OpenIn(dir, name, os.O_RDONLY)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-n, 0)
	buf := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil {
		return ""
	}
	return strings.Join(strings.Fields(string(buf)), " ")
}

// CapFile keeps the file name in dir (a console log) under max bytes: past it, the file keeps
// its newest half. The VMM appends, so its writes land after the cut. A missing file is fine;
// one OpenIn refuses is an error. It runs four times a second for each file of each VM: a
// regular file under the cap costs one lstat, and only one past it is opened (OpenIn).
func CapFile(dir, name string, max int64) error {
	if fi, err := os.Lstat(filepath.Join(dir, name)); os.IsNotExist(err) || err == nil && fi.Mode().IsRegular() && fi.Size() <= max {
		return nil
	}
	f, err := OpenIn(dir, name, os.O_RDWR)
	if os.IsNotExist(err) {
		return nil
	} else if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() <= max {
		return err
	}
	keep := make([]byte, max/2)
	if _, err := f.ReadAt(keep, fi.Size()-int64(len(keep))); err != nil {
		return err
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err = f.WriteAt(append([]byte("[imp: console log capped; older output dropped]\n"), keep...), 0)
	return err
}

// ListenUnix makes a listening unix socket at path (replacing what is there) and returns it as
// a file, to hand to a VMM. A long path is bound as DialUnix connects (unixAddr).
func ListenUnix(path string) (*os.File, error) {
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	var l *net.UnixListener
	err := unixAddr(path, func(addr string) (err error) {
		l, err = net.ListenUnix("unix", &net.UnixAddr{Name: addr, Net: "unix"})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	l.SetUnlinkOnClose(false) // the VMM listens on it from now on
	defer l.Close()
	f, err := l.File()
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}
