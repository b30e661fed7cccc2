package snapshot

import (
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// LinkDisk makes dst, a new name, the read-only disk image src: a hard link (a base disk is
// never changed once built: one built again is a new file), or a copy (0444) where the two are
// on different file systems. It is how a snapshot keeps its VM's base disk, and a restored run
// gets the snapshot's.
func LinkDisk(src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	if err := CopyDisk(src, dst); err != nil {
		return err
	}
	return os.Chmod(dst, 0o444)
}

// CopyDisk copies the disk image src to dst, a new file (0600), sparse: a reflink where the
// file system shares blocks (FICLONE), else only the extents that hold data. It is what makes
// a snapshot's disk, and a restored VM's disk from it.
func CopyDisk(src, dst string) (err error) {
	in, err := os.OpenFile(src, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("opening the disk %s: %w", src, err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("creating the disk %s: %w", dst, err)
	}
	defer func() {
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(dst)
		}
	}()
	return Copy(in, out)
}

// Copy copies the open file in into the empty file out: a reflink where the file system shares
// blocks, else only the extents of in that hold data.
func Copy(in, out *os.File) error {
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	size := fi.Size()
	if err := out.Truncate(size); err != nil {
		return err
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // only a hole is left
		} else if err != nil {
			return fmt.Errorf("finding data in %s: %w", in.Name(), err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("finding a hole in %s: %w", in.Name(), err)
		}
		if err := copyRange(in, out, data, hole-data); err != nil {
			return fmt.Errorf("copying %s: %w", in.Name(), err)
		}
		off = hole
	}
	return nil
}

// copyRange copies n bytes at off of in to the same offset of out, in the kernel where it can.
func copyRange(in, out *os.File, off, n int64) error {
	for n > 0 {
		roff, woff := off, off
		c, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(min(n, 1<<30)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EINVAL) {
				return sendRange(in, out, off, n)
			}
			return err
		}
		if c == 0 {
			return io.ErrUnexpectedEOF
		}
		off += int64(c)
		n -= int64(c)
	}
	return nil
}

// sendRange copies n bytes at off of in to the same offset of out where copy_file_range cannot
// (two file systems: a memfd and a disk): sendfile, still in the kernel, else read and write.
func sendRange(in, out *os.File, off, n int64) error {
	if _, err := out.Seek(off, io.SeekStart); err != nil {
		return err
	}
	for n > 0 {
		c, err := unix.Sendfile(int(out.Fd()), int(in.Fd()), &off, int(min(n, 1<<30)))
		if err != nil {
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
				_, err := io.Copy(io.NewOffsetWriter(out, off), io.NewSectionReader(in, off, n))
				return err
			}
			return err
		}
		if c == 0 {
			return io.ErrUnexpectedEOF
		}
		n -= int64(c)
	}
	return nil
}
