package guestinit

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// volumesDir holds, in the root, a read-only tmpfs per volume of files, from which its mounts
// are bound: a restored guest's files are rewritten there, in place, and every mount of them
// sees the new ones.
const volumesDir = "/run/imp/volumes"

// volumeDirs are descriptors of the disk volumes mounted writable: at power-off each is frozen
// (FIFREEZE checkpoints ext4's journal), so that a claim lies consistent for whoever mounts it
// next, a reader of a write-protected disk included (which cannot replay a journal).
var volumeDirs []int

// mountVolumes mounts the run's volumes in the root (cfg.Mounts) and makes its disks' device
// nodes (cfg.Devices), before the workload starts: volumes of files staged once each on a
// tmpfs, then bound read-only at each mount; disks mounted from the block device of their
// serial.
func mountVolumes(cfg Config, timeout time.Duration) error {
	vols := make(map[string]*Volume, len(cfg.Volumes))
	for i := range cfg.Volumes {
		v := &cfg.Volumes[i]
		vols[v.Name] = v
		if v.Serial != "" {
			continue
		}
		if err := stageFiles(v); err != nil {
			return fmt.Errorf("volume %s: %w", v.Name, err)
		}
	}
	for _, m := range cfg.Mounts {
		v := vols[m.Volume]
		if v == nil {
			return fmt.Errorf("mount %s names no volume %q", m.Path, m.Volume)
		}
		if err := mountOne(v, m, timeout); err != nil {
			return fmt.Errorf("mounting volume %s at %s: %w", v.Name, m.Path, err)
		}
	}
	for _, d := range cfg.Devices {
		v := vols[d.Volume]
		if v == nil || v.Serial == "" {
			return fmt.Errorf("device %s names no disk volume %q", d.Path, d.Volume)
		}
		if err := makeDevice(v, d.Path, timeout); err != nil {
			return fmt.Errorf("volume %s at %s: %w", v.Name, d.Path, err)
		}
	}
	return nil
}

// cleanAbs is p, an absolute path, cleaned; an error for a relative one, one with "..", or one
// that is / or under /proc, /sys or /dev once cleaned (where the guest's own kernel interfaces
// are: a device path goes under /dev, with allowDev).
func cleanAbs(p string, allowDev bool) (string, error) {
	if !path.IsAbs(p) || slices.Contains(strings.Split(p, "/"), "..") {
		return "", fmt.Errorf("%q is not an absolute path without '..'", p)
	}
	c := path.Clean(p)
	for _, d := range []string{"/proc", "/sys", "/dev"} {
		if c == "/" || c == d || strings.HasPrefix(c, d+"/") && (d != "/dev" || !allowDev) {
			return "", fmt.Errorf("%q is / or under /proc, /sys or /dev", p)
		}
	}
	return c, nil
}

// cleanRel is p, a path relative to a volume, cleaned; an error for an absolute one or one
// with "..".
func cleanRel(p string) (string, error) {
	if p == "" || path.IsAbs(p) || slices.Contains(strings.Split(p, "/"), "..") {
		return "", fmt.Errorf("%q is not a relative path without '..'", p)
	}
	return path.Clean(p), nil
}

func stageDir(v *Volume) string { return filepath.Join(volumesDir, v.Name) }

// stageFiles makes v's tmpfs and writes its files there, read-only.
func stageFiles(v *Volume) error {
	dir := stageDir(v)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return fmt.Errorf("mounting its tmpfs: %w", err)
	}
	return writeFiles(dir, v.Files)
}

// writeFiles writes files under dir, a volume's tmpfs, read-only before and after: an existing
// file is written in place (a mount of it alone keeps seeing it), one no longer among files
// removed.
func writeFiles(dir string, files []File) error {
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return fmt.Errorf("making its tmpfs writable: %w", err)
	}
	keep := map[string]bool{}
	for _, f := range files {
		rel, err := cleanRel(f.Path)
		if err != nil {
			return err
		}
		p := filepath.Join(dir, rel)
		keep[p] = true
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		for d := filepath.Dir(p); d != dir; d = filepath.Dir(d) {
			keep[d] = true
		}
		fd, err := unix.Open(p, unix.O_WRONLY|unix.O_CREAT|unix.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, f.Mode&0o777)
		if err != nil {
			return fmt.Errorf("writing %s: %w", rel, err)
		}
		file := os.NewFile(uintptr(fd), p)
		_, err = file.Write(f.Data)
		err = errors.Join(err, file.Chmod(fs.FileMode(f.Mode&0o777)), file.Close())
		if err != nil {
			return fmt.Errorf("writing %s: %w", rel, err)
		}
	}
	// What an earlier identity's files left (a restored guest's), deepest first.
	var gone []string
	_ = filepath.WalkDir(dir, func(p string, _ fs.DirEntry, err error) error {
		if err == nil && p != dir && !keep[p] {
			gone = append(gone, p)
		}
		return nil
	})
	slices.Reverse(gone)
	for _, p := range gone {
		_ = os.Remove(p)
	}
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return fmt.Errorf("making its tmpfs read-only: %w", err)
	}
	return nil
}

// mountOne mounts v at m.Path.
func mountOne(v *Volume, m Mount, timeout time.Duration) error {
	target, err := cleanAbs(m.Path, false)
	if err != nil {
		return err
	}
	if v.Serial != "" {
		dev, err := deviceOf(v.Serial, timeout)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
		var flags uintptr
		if m.ReadOnly {
			flags |= unix.MS_RDONLY
		}
		err = unix.Mount(dev, target, "ext4", flags, "")
		if flags&unix.MS_RDONLY == 0 && (errors.Is(err, unix.EACCES) || errors.Is(err, unix.EROFS)) {
			// A write-protected disk (the node holds the claim read-only): mounted read-only,
			// as mount(8) does.
			flags |= unix.MS_RDONLY
			err = unix.Mount(dev, target, "ext4", flags, "")
		}
		if flags&unix.MS_RDONLY != 0 && errors.Is(err, unix.EROFS) {
			// Read-only, and its journal wants replaying (its last writer stopped without
			// unmounting it), which a write-protected disk cannot: read as it is, without
			// the journal's last transactions.
			err = unix.Mount(dev, target, "ext4", flags, "noload")
		}
		if err == nil && flags&unix.MS_RDONLY == 0 {
			// Kept, to freeze it at power-off, as the writable disk is (Run).
			if fd, err := unix.Open(target, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
				volumeDirs = append(volumeDirs, fd)
			}
		}
		return err
	}
	src := stageDir(v)
	if m.SubPath != "" {
		rel, err := cleanRel(m.SubPath)
		if err != nil {
			return err
		}
		src = filepath.Join(src, rel)
	}
	fi, err := os.Lstat(src)
	switch {
	case errors.Is(err, fs.ErrNotExist) && m.SubPath != "":
		return fmt.Errorf("the volume has no %s", m.SubPath)
	case err != nil:
		return err
	case fi.IsDir():
		if err := os.MkdirAll(target, 0o755); err != nil {
			return err
		}
	default: // one file: bound onto a file
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		if f, err := os.OpenFile(target, os.O_RDONLY|os.O_CREATE, 0o644); err == nil {
			f.Close()
		}
	}
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return err
	}
	return unix.Mount("", target, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, "")
}

// makeDevice makes a block device node at p for the disk of v.
func makeDevice(v *Volume, p string, timeout time.Duration) error {
	target, err := cleanAbs(p, true)
	if err != nil {
		return err
	}
	dev, err := deviceOf(v.Serial, timeout)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	_ = os.Remove(target)
	return unix.Mknod(target, unix.S_IFBLK|0o660, int(st.Rdev))
}

// deviceOf is the block device whose serial is serial, waited for until timeout.
func deviceOf(serial string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	for {
		if dev := serialDevice(serial); dev != "" {
			return dev, nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no block device with serial %q", serial)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func serialDevice(serial string) string {
	devs, _ := filepath.Glob("/sys/block/vd*")
	for _, d := range devs {
		if blockSerial(filepath.Base(d)) == serial {
			return "/dev/" + filepath.Base(d)
		}
	}
	return ""
}

// blockSerial is the serial of the virtio block device named dev (vda), "" for none.
func blockSerial(dev string) string {
	b, err := os.ReadFile(filepath.Join("/sys/block", dev, "serial"))
	if err != nil {
		return ""
	}
	return strings.TrimRight(string(b), "\x00\n ")
}

// isVolumeDevice reports whether the block device path dev (/dev/vdX) is a volume's, which
// is never one of the VM's own disks, whatever it holds.
func isVolumeDevice(dev string) bool {
	return strings.HasPrefix(blockSerial(filepath.Base(dev)), VolumeSerialPrefix)
}

// refreshVolumes rewrites, in a guest restored from a snapshot (or a warm pool's member handed
// to its claim), its volumes of files with the restored VM's own (cfg). Every volume and mount
// of the snapshot's VM (old) must be the restored VM's too, at the same places (its mounts are
// in the snapshot's memory), and its devices the same; the restored VM may add volumes of
// files and mounts of them, which are staged and mounted now (a disk cannot be added: the VMM
// has the disks it was started with).
func refreshVolumes(old, cfg Config) error {
	if !slices.Equal(old.Devices, cfg.Devices) {
		return fmt.Errorf("the VM's devices differ from those of the VM its snapshot was taken of")
	}
	had := make(map[string]*Volume, len(old.Volumes))
	for i := range old.Volumes {
		had[old.Volumes[i].Name] = &old.Volumes[i]
	}
	vols := make(map[string]*Volume, len(cfg.Volumes))
	for i := range cfg.Volumes {
		vols[cfg.Volumes[i].Name] = &cfg.Volumes[i]
	}
	for name, o := range had {
		if v := vols[name]; v == nil || (v.Serial == "") != (o.Serial == "") {
			return fmt.Errorf("the VM's volume %s differs from that of the VM its snapshot was taken of, or is missing", name)
		}
	}
	for _, m := range old.Mounts {
		if !slices.Contains(cfg.Mounts, m) {
			return fmt.Errorf("the VM does not mount volume %s at %s as the VM its snapshot was taken of did", m.Volume, m.Path)
		}
	}
	for i := range cfg.Volumes {
		v := &cfg.Volumes[i]
		switch {
		case had[v.Name] == nil && v.Serial != "":
			return fmt.Errorf("disk volume %s was not the snapshot's VM's: a restored VM cannot add a disk", v.Name)
		case had[v.Name] == nil:
			if err := stageFiles(v); err != nil {
				return fmt.Errorf("volume %s: %w", v.Name, err)
			}
		case v.Serial == "":
			if err := writeFiles(stageDir(v), v.Files); err != nil {
				return fmt.Errorf("volume %s: %w", v.Name, err)
			}
		}
	}
	for _, m := range cfg.Mounts {
		if slices.Contains(old.Mounts, m) {
			continue
		}
		v := vols[m.Volume]
		if v == nil || v.Serial != "" {
			return fmt.Errorf("mount %s names no volume of files %q", m.Path, m.Volume)
		}
		// The workload has run in this guest: a link it left on the way is not followed
		// by the mount, made as root.
		if err := noLinks(m.Path); err != nil {
			return fmt.Errorf("mounting volume %s at %s: %w", v.Name, m.Path, err)
		}
		if err := mountOne(v, m, 0); err != nil {
			return fmt.Errorf("mounting volume %s at %s: %w", v.Name, m.Path, err)
		}
	}
	return nil
}

// noLinks refuses an absolute path p of which a part that exists is a symbolic link.
func noLinks(p string) error {
	clean, err := cleanAbs(p, false)
	if err != nil {
		return err
	}
	at := "/"
	for _, part := range strings.Split(strings.TrimPrefix(clean, "/"), "/") {
		at = filepath.Join(at, part)
		fi, err := os.Lstat(at)
		if errors.Is(err, fs.ErrNotExist) {
			return nil // made by the mount, as directories
		} else if err != nil {
			return err
		}
		if fi.Mode()&fs.ModeSymlink != 0 {
			return fmt.Errorf("%s is a symbolic link", at)
		}
	}
	return nil
}
