// Package loop binds a file to a loop device of the node, for a VMM that opens its disks by
// path where the file is not: Firecracker, in its jail, and a Filesystem claim's disk image,
// which lives on the claim's file system. The device detaches itself once its last user
// closes it (LO_FLAGS_AUTOCLEAR): nothing is left bound when a VMM or the agent ends, however
// they end. It is bound without partition scanning (the node's kernel never parses a partition
// table the guest wrote; a node whose loop module scans every device's is refused) and with
// direct I/O to the file where the file's system allows it (no
// second copy of the disk in the node's page cache).
package loop

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Devices binds files to the node's loop devices.
type Devices struct {
	// Control is the loop control device (default /dev/loop-control); where there is none,
	// a node of it is made for the moment.
	Control string
	// Sys is where sysfs is mounted (default /sys): a loop device's numbers are read there,
	// since the agent's /dev need not have a node of a device made after it started.
	Sys string
}

// attempts bounds how often a free device is looked for again when another binder took the one
// the kernel named first.
const attempts = 16

// Attach binds backing (open read-write, or read-only for readOnly) to a free loop device and
// makes path a node (0600, root's) of that device, replacing whatever was there and following
// no link. It returns the device, open; the caller closes it once the VMM has opened path (or
// on failure): the binding ends when the last of them closes it.
func (d Devices) Attach(path string, backing *os.File, readOnly bool) (*os.File, error) {
	if err := d.noPartitions(); err != nil {
		return nil, err
	}
	ctl, err := d.control(path)
	if err != nil {
		return nil, fmt.Errorf("opening the loop control device: %w", err)
	}
	defer ctl.Close()
	cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
	cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR | unix.LO_FLAGS_DIRECT_IO
	mode := os.O_RDWR
	if readOnly {
		cfg.Info.Flags |= unix.LO_FLAGS_READ_ONLY
		mode = os.O_RDONLY
	}
	copy(cfg.Info.File_name[:unix.LO_NAME_SIZE-1], "imp:"+filepath.Base(path))
	for range attempts {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("finding a free loop device: %w", err)
		}
		dev, err := d.number(n)
		if err != nil {
			return nil, err
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("removing what was at %s: %w", path, err)
		}
		if err := unix.Mknod(path, unix.S_IFBLK|0o600, int(dev)); err != nil {
			return nil, fmt.Errorf("making a node of loop device %d: %w", n, err)
		}
		f, err := os.OpenFile(path, mode|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
		if err != nil {
			return nil, fmt.Errorf("opening loop device %d: %w", n, err)
		}
		err = unix.IoctlLoopConfigure(int(f.Fd()), &cfg)
		if err == nil {
			if st, err := unix.IoctlLoopGetStatus64(int(f.Fd())); err != nil || st.Flags&unix.LO_FLAGS_PARTSCAN != 0 {
				// Scanning partitions whatever it was asked: unbound, refused.
				_ = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
				f.Close()
				return nil, fmt.Errorf("loop device %d scans the image's partitions (%v): refusing to bind a tenant's disk image to it", n, err)
			}
			return f, nil
		}
		f.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("binding the disk image to loop device %d: %w", n, err)
		}
		// Another binder (the node's, another VM's start) took it first.
	}
	return nil, fmt.Errorf("no loop device stayed free for the disk image in %d attempts", attempts)
}

// control opens the loop control device: Control, or, where there is none (the agent's
// container's /dev was made before the node loaded the loop module), a node of it made beside
// path for the moment of the open (opening it loads the module).
func (d Devices) control(path string) (*os.File, error) {
	control := d.Control
	if control == "" {
		control = "/dev/loop-control"
	}
	f, err := os.OpenFile(control, os.O_RDWR|unix.O_CLOEXEC, 0)
	if !errors.Is(err, os.ErrNotExist) {
		return f, err
	}
	node := path + ".loop-control"
	_ = os.Remove(node)
	if err := unix.Mknod(node, unix.S_IFCHR|0o600, int(unix.Mkdev(miscMajor, loopControlMinor))); err != nil {
		return nil, err
	}
	defer os.Remove(node)
	return os.OpenFile(node, os.O_RDWR|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
}

// The loop control device's numbers (Documentation/admin-guide/devices.txt).
const (
	miscMajor        = 10
	loopControlMinor = 237
)

// noPartitions refuses a node whose loop module scans every device's partitions (its max_part
// parameter set): the node's kernel would parse the partition table a guest wrote.
func (d Devices) noPartitions() error {
	b, err := os.ReadFile(filepath.Join(d.sys(), "module", "loop", "parameters", "max_part"))
	if err != nil {
		return nil // built without the parameter, or not loaded yet (loaded with its default, 0)
	}
	if v := strings.TrimSpace(string(b)); v != "0" {
		return fmt.Errorf("the node's loop module scans partitions (max_part=%s): a disk image the guest writes would have its partition table parsed by the node's kernel; load it with max_part=0 to run Firecracker VMs with Filesystem claims", v)
	}
	return nil
}

func (d Devices) sys() string {
	if d.Sys == "" {
		return "/sys"
	}
	return d.Sys
}

// number is the device number of loop device n, as sysfs has it ("7:n" without partitions).
func (d Devices) number(n int) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(d.sys(), "block", "loop"+strconv.Itoa(n), "dev"))
	if err != nil {
		return 0, fmt.Errorf("reading loop device %d's number: %w", n, err)
	}
	maj, min, ok := strings.Cut(strings.TrimSpace(string(b)), ":")
	ma, err1 := strconv.ParseUint(maj, 10, 32)
	mi, err2 := strconv.ParseUint(min, 10, 32)
	if !ok || err1 != nil || err2 != nil {
		return 0, fmt.Errorf("loop device %d's number %q", n, b)
	}
	return unix.Mkdev(uint32(ma), uint32(mi)), nil
}
