package volume

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// HolderReady reports whether vm's PersistentVolumeClaims are held on its node, ready for its
// VMM (status.volumeHolder, the operator's); a VM without claims is always ready.
func HolderReady(vm *impv1.ImpVM) bool {
	if len(vm.Spec.Claims()) == 0 {
		return true
	}
	h := vm.Status.VolumeHolder
	return h != nil && h.Ready && h.PodUID != "" && h.ContainerID != "" && h.NodeName == vm.Status.NodeName
}

// claimDisk opens the disk of the VM's claim held as c by the holder h: a Block
// claim's device, or a Filesystem claim's disk image (disk.img, made at the claim's size on
// first use: ext4 when mounted). Everything is reached beneath the root of the holder's
// container (its mount namespace, where the kubelet put the claim), with no symbolic link
// followed: what the tenant's claim holds cannot point the node at anything else.
//
// A claim the node holds read-only is opened read-only, and says so (ro), whatever the VM
// asked: a device the kernel marks read-only (BLKROGET; a read-only PersistentVolume's, a
// read-only loop device), or a file system the kubelet mounted read-only (EROFS).
func (m Maker) claimDisk(h *impv1.VolumeHolderStatus, c impv1.HeldClaim, readOnly, mounted bool) (f *os.File, ro bool, err error) {
	root, err := m.holderRoot(h.PodUID, h.ContainerID)
	if err != nil {
		return nil, false, err
	}
	defer root.Close()
	flags := unix.O_RDWR
	if readOnly {
		flags = unix.O_RDONLY
	}
	if c.Block {
		dev := strings.TrimPrefix(impv1.HolderDeviceDir, "/") + "/" + c.Volume
		f, err := openKind(root, dev, flags, unix.S_IFBLK)
		if !readOnly && (errors.Is(err, unix.EACCES) || errors.Is(err, unix.EROFS)) {
			// A read-only device refuses a writer: opened read-only if that is why.
			readOnly = true
			f, err = openKind(root, dev, unix.O_RDONLY, unix.S_IFBLK)
		}
		if err != nil {
			return nil, false, fmt.Errorf("opening the claim's device in the holder pod: %w", err)
		}
		if !readOnly {
			kro, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET)
			if err != nil {
				f.Close()
				return nil, false, fmt.Errorf("asking whether the claim's device is read-only: %w", err)
			}
			readOnly = kro != 0
		} else if kro, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET); err != nil || (kro == 0 && flags == unix.O_RDWR) {
			f.Close()
			return nil, false, fmt.Errorf("the claim's device refused a writer but is not read-only: %v", err)
		}
		if mounted && !readOnly {
			if err := m.formatIfBlank(f); err != nil {
				f.Close()
				return nil, false, err
			}
		}
		return f, readOnly, nil
	}
	dir := strings.TrimPrefix(impv1.HolderMountDir, "/") + "/" + c.Volume
	name := dir + "/disk.img"
	f, err = openKind(root, name, flags, unix.S_IFREG)
	if !readOnly && errors.Is(err, unix.EROFS) {
		readOnly = true
		f, err = openKind(root, name, unix.O_RDONLY, unix.S_IFREG)
		if errors.Is(err, unix.ENOENT) {
			return nil, false, errors.New("the claim is mounted read-only and holds no disk.img to read")
		}
	}
	if errors.Is(err, unix.ENOENT) && !readOnly {
		f, err = m.makeImage(root, dir, name, c.SizeBytes, mounted)
		return f, false, err
	}
	if err != nil {
		return nil, false, fmt.Errorf("opening disk.img on the claim: %w", err)
	}
	return f, readOnly, nil
}

// openKind opens name beneath root (openBeneath) only if it is a file of type kind
// (unix.S_IFREG, unix.S_IFBLK): it is looked at through an O_PATH descriptor first, which opens
// nothing, so that a FIFO, a character device or a terminal the tenant put in its place is never
// opened (a FIFO would block the agent; a device's open has effects of its own).
func openKind(root *os.File, name string, flags int, kind uint32) (*os.File, error) {
	p, err := openBeneath(root, name, unix.O_PATH, 0)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(p.Fd()), &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != kind {
		return nil, fmt.Errorf("%s on the claim is not a %s", path.Base(name), map[uint32]string{unix.S_IFREG: "regular file", unix.S_IFBLK: "block device"}[kind])
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", p.Fd()), flags|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), name)
	// The same file as the one looked at (the magic link reopens that inode).
	var again unix.Stat_t
	if err := unix.Fstat(fd, &again); err != nil || again.Ino != st.Ino || again.Dev != st.Dev {
		f.Close()
		return nil, fmt.Errorf("%s on the claim changed while it was opened", path.Base(name))
	}
	return f, nil
}

// makeImage makes the disk image of a Filesystem claim: at most the claim's size, within the
// file system's (less 5% for its own needs), whole MiB; made aside and renamed into place.
func (m Maker) makeImage(root *os.File, dir, name string, size int64, ext4 bool) (*os.File, error) {
	d, err := openBeneath(root, dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the claim's directory in the holder pod: %w", err)
	}
	defer d.Close()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(d.Fd()), &st); err != nil {
		return nil, err
	}
	if fsSize := int64(st.Blocks) * st.Bsize * 95 / 100; size <= 0 || size > fsSize {
		size = fsSize
	}
	size = size >> 20 << 20
	if size < 16<<20 {
		return nil, fmt.Errorf("the claim's file system has room for a disk of %d bytes, less than 16 MiB", size)
	}
	tmpName := "disk.img.tmp"
	_ = unix.Unlinkat(int(d.Fd()), tmpName, 0)
	fd, err := unix.Openat(int(d.Fd()), tmpName, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("making disk.img on the claim: %w", err)
	}
	f := os.NewFile(uintptr(fd), tmpName)
	fail := func(err error) (*os.File, error) {
		f.Close()
		_ = unix.Unlinkat(int(d.Fd()), tmpName, 0)
		return nil, err
	}
	if err := f.Truncate(size); err != nil {
		return fail(fmt.Errorf("sizing disk.img on the claim: %w", err))
	}
	if ext4 {
		if err := m.mkfs(f); err != nil {
			return fail(err)
		}
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := unix.Renameat(int(d.Fd()), tmpName, int(d.Fd()), "disk.img"); err != nil {
		return fail(fmt.Errorf("installing disk.img on the claim: %w", err))
	}
	return f, nil
}

// mkfs makes an empty ext4 file system (label guestinit.VolumeLabel) on the open file f.
func (m Maker) mkfs(f *os.File) error {
	mkfs := m.Mkfs
	if mkfs == "" {
		mkfs = "mkfs.ext4"
	}
	cmd := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-E", "lazy_itable_init=1,lazy_journal_init=1", "-L", guestinit.VolumeLabel, "/dev/fd/3")
	cmd.ExtraFiles = []*os.File{f}
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("making its file system: %w: %s", err, out)
	}
	return nil
}

// formatIfBlank makes an ext4 file system on a Block claim to be mounted whose first MiB is
// zeros (new): a device that holds anything is left as it is.
func (m Maker) formatIfBlank(f *os.File) error {
	head := make([]byte, 1<<20)
	n, err := f.ReadAt(head, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("reading the claim's device: %w", err)
	}
	if !bytes.Equal(head[:n], make([]byte, n)) {
		return nil
	}
	return m.mkfs(f)
}

// openBeneath opens name beneath root (a directory), resolving it as if root were "/" and
// following no link of any kind.
func openBeneath(root *os.File, name string, flags int, mode uint32) (*os.File, error) {
	fd, err := unix.Openat2(int(root.Fd()), name, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW),
		Mode:    uint64(mode),
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), name), nil
}

// holderRoot opens the root directory of the holder pod's hold container: of a process whose
// cgroup names both the pod (podUID) and the container (containerID, "runtime://ID"), and
// whose root holds the holder's directories. No other container of the pod (the sandbox's
// pause, an ephemeral container a tenant added) is ever taken for it. The process is pinned by
// its /proc directory while its cgroup and root are read, so that a pid reused meanwhile is
// never taken for it.
func (m Maker) holderRoot(podUID, containerID string) (*os.File, error) {
	_, id, _ := strings.Cut(containerID, "://")
	if len(id) < 8 || strings.ContainsAny(id, "/\n") {
		return nil, fmt.Errorf("the holder's container ID %q is not one", containerID)
	}
	proc := m.Proc
	if proc == "" {
		proc = "/proc"
	}
	ids := []string{"pod" + podUID, "pod" + strings.ReplaceAll(podUID, "-", "_")}
	entries, err := os.ReadDir(proc)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		pd, err := os.Open(filepath.Join(proc, e.Name()))
		if err != nil {
			continue
		}
		if root := holderRootOf(pd, ids, id); root != nil {
			pd.Close()
			return root, nil
		}
		pd.Close()
	}
	return nil, fmt.Errorf("no process of the holder pod %s (container %s) runs on this node", podUID, id)
}

func holderRootOf(pd *os.File, ids []string, container string) *os.File {
	cg, err := openBeneath(pd, "cgroup", unix.O_RDONLY, 0)
	if err != nil {
		return nil
	}
	b, _ := io.ReadAll(io.LimitReader(cg, 64<<10))
	cg.Close()
	if !strings.Contains(string(b), ids[0]) && !strings.Contains(string(b), ids[1]) || !strings.Contains(string(b), container) {
		return nil
	}
	fd, err := unix.Openat(int(pd.Fd()), "root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil
	}
	root := os.NewFile(uintptr(fd), "root")
	for _, d := range []string{impv1.HolderMountDir, impv1.HolderDeviceDir} {
		if f, err := openBeneath(root, strings.TrimPrefix(d, "/"), unix.O_PATH|unix.O_DIRECTORY, 0); err == nil {
			f.Close()
			return root
		}
	}
	root.Close()
	return nil
}
