// Package volume makes a run's volumes on the node: the disks of its emptyDisk volumes (files in
// the VM's state directory, kept across its runs there, ext4 when mounted, raw otherwise), and
// the files of its secret, configMap and downwardAPI volumes, which go to the guest on the run's
// configuration disk. What it makes is what the VMM attaches (vmrun.Volumes.Drives) and what
// imp-init mounts (vmrun.Volumes.Guest); see docs/volumes.md.
package volume

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/agent/volume/loop"
	"github.com/syscode-labs/imp/internal/guestinit"
	"golang.org/x/sys/unix"
)

// Maker makes runs' volumes.
type Maker struct {
	// Mkfs is the mkfs.ext4 to run (default: from PATH).
	Mkfs string
	// ChooseVMM is the VMM a VM runs under on this node: a disk's serial depends on it.
	ChooseVMM func(*impv1.ImpVM) (impv1.VMMKind, error)
	// Proc is where the node's processes are (default /proc): the holder pods' among them.
	Proc string
	// Loops bind Filesystem claims' disk images to loop devices for Firecracker.
	Loops loop.Devices
}

// DiskFile is the file, in a VM's state directory, of its emptyDisk volume name.
func DiskFile(name string) string { return "vol-" + name + ".img" }

// Make makes the volumes of r's VM. Its disks are made when missing and kept when there (they
// hold what the guest wrote); its volumes of files are resolved anew (from the run's Secret
// and the VM), unless r has no image (a resume: its guest has them already).
func (m Maker) Make(r *vmrun.Run) (*vmrun.Volumes, error) {
	vm := r.VM
	kind := impv1.VMMKind("")
	switch {
	case r.Meta != nil:
		kind = r.Meta.VMM
	case r.Incoming && r.Old != nil:
		kind = r.Old.VMM // a migration's run: under its source's VMM
	}
	if kind == "" {
		var err error
		if kind, err = m.ChooseVMM(vm); err != nil {
			return nil, err
		}
	}
	mounted := map[string]bool{}
	for _, mt := range vm.Spec.VolumeMounts {
		mounted[mt.Name] = true
	}
	out := &vmrun.Volumes{}
	for i := range vm.Spec.Volumes {
		v := &vm.Spec.Volumes[i]
		gv := guestinit.Volume{Name: v.Name}
		switch {
		case v.EmptyDisk != nil:
			path := r.Path(DiskFile(v.Name))
			size, err := v.EmptyDisk.Bytes()
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			// A migration's run: the source's mirror writes the whole disk over sparse zeros.
			if err := m.ensureDisk(path, size, mounted[v.Name] && !r.Incoming); err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			serial, err := serialOf(kind, i, path)
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			gv.Serial = serial
			out.Drives = append(out.Drives, vmm.Drive{ID: v.Name, Path: path, Serial: serial, Own: true})
		case v.PersistentVolumeClaim != nil:
			d, err := m.claimDrive(r, kind, i, v, mounted[v.Name])
			if err != nil {
				return nil, fmt.Errorf("volume %s (PersistentVolumeClaim %s): %w", v.Name, v.PersistentVolumeClaim.ClaimName, err)
			}
			gv.Serial = d.Serial
			out.Drives = append(out.Drives, d)
		case r.Image == nil:
			// A resume: the guest has its files.
		case v.Secret != nil || v.ConfigMap != nil:
			files, err := r.Image.Secrets.Files(i)
			if err != nil {
				return nil, err
			}
			for _, f := range files {
				gv.Files = append(gv.Files, guestinit.File{Path: f.Path, Mode: f.Mode, Data: f.Data})
			}
		case v.DownwardAPI != nil:
			files, err := downward(vm, v.DownwardAPI)
			if err != nil {
				return nil, fmt.Errorf("volume %s: %w", v.Name, err)
			}
			gv.Files = files
		}
		out.Guest.Volumes = append(out.Guest.Volumes, gv)
	}
	for _, mt := range vm.Spec.VolumeMounts {
		out.Guest.Mounts = append(out.Guest.Mounts, guestinit.Mount{Volume: mt.Name, Path: mt.MountPath, SubPath: mt.SubPath, ReadOnly: mt.ReadOnly})
	}
	for _, d := range vm.Spec.VolumeDevices {
		out.Guest.Devices = append(out.Guest.Devices, guestinit.Device{Volume: d.Name, Path: d.DevicePath})
	}
	return out, nil
}

// claimDrive is the drive of the VM's i-th volume v, a claim, opened in its holder pod for the
// run (closed when the run's start is done: the VMM has its own descriptor, or its jail a node
// of the device).
func (m Maker) claimDrive(r *vmrun.Run, kind impv1.VMMKind, i int, v *impv1.Volume, mounted bool) (vmm.Drive, error) {
	vm := r.VM
	h := vm.Status.VolumeHolder
	if !HolderReady(vm) {
		return vmm.Drive{}, errors.New("its holder pod is not ready on this node")
	}
	var c *impv1.HeldClaim
	for j := range h.Claims {
		if h.Claims[j].Volume == v.Name {
			c = &h.Claims[j]
		}
	}
	if c == nil {
		return vmm.Drive{}, fmt.Errorf("its holder pod %s does not hold it", h.PodName)
	}
	ro := v.PersistentVolumeClaim.ReadOnly || c.ReadOnly
	f, nodeRO, err := m.claimDisk(h, *c, ro, mounted)
	if err != nil {
		return vmm.Drive{}, err
	}
	ro = ro || nodeRO
	r.Defer(func() { f.Close() })
	d := vmm.Drive{ID: v.Name, File: f, ReadOnly: ro, Block: c.Block, Serial: guestinit.VolumeSerialPrefix + strconv.Itoa(i)}
	if kind == impv1.VMMFirecracker {
		// Firecracker opens its drives by path, in its jail: a node of the claim's device in
		// the VM's state directory, linked into the jail as the other disks are. A disk image
		// on the claim's file system, which the jail cannot reach, is bound to a loop device
		// first; Firecracker opens it as the start configures its drives, and the binding
		// ends with the last of them to close it (the VMM exits, or the agent, before).
		path := r.Path(DiskFile(v.Name))
		dev := f
		if !c.Block {
			l, err := m.Loops.Attach(path, f, ro)
			if err != nil {
				return vmm.Drive{}, err
			}
			r.Defer(func() { l.Close() })
			dev = l
		}
		if err := deviceNode(path, dev); err != nil {
			return vmm.Drive{}, err
		}
		if d.Serial, err = firecracker.DriveSerial(path); err != nil {
			return vmm.Drive{}, err
		}
		d.Path, d.File = path, nil
	}
	return d, nil
}

// deviceNode makes path a block device node (0600, root's) of the device f is open on, unless it
// is one already.
func deviceNode(path string, f *os.File) error {
	var st, cur unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return err
	}
	if unix.Lstat(path, &cur) == nil && cur.Mode&unix.S_IFMT == unix.S_IFBLK && cur.Rdev == st.Rdev {
		return nil
	}
	_ = os.Remove(path)
	if err := unix.Mknod(path, unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
		return fmt.Errorf("making a node of the claim's device: %w", err)
	}
	return nil
}

// serialOf is the serial the guest reads of the i-th volume's disk at path: under QEMU one the
// agent gives it (guestinit.VolumeSerialPrefix and i, at most 20 bytes as virtio allows), under
// Firecracker the one it derives from the file.
func serialOf(kind impv1.VMMKind, i int, path string) (string, error) {
	if kind == impv1.VMMFirecracker {
		return firecracker.DriveSerial(path)
	}
	return guestinit.VolumeSerialPrefix + strconv.Itoa(i), nil
}

// ensureDisk makes the disk of size bytes at path unless it is there: sparse zeros, holding an
// empty ext4 file system (label guestinit.VolumeLabel) when it is to be mounted. It is made
// aside and renamed into place, so that a disk at path is always whole.
func (m Maker) ensureDisk(path string, size int64, ext4 bool) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if err == nil && ext4 {
		err = m.mkfs(f)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("making the disk: %w", err)
	}
	return os.Rename(tmp, path)
}

// downward is the files of a downwardAPI volume of vm, as the kubelet writes a Pod's: a label
// or annotation map one key="value" line each (the value quoted as Go quotes it), sorted.
func downward(vm *impv1.ImpVM, src *impv1.DownwardAPIVolumeSource) ([]guestinit.File, error) {
	mode := uint32(0o644)
	if src.DefaultMode != nil {
		mode = uint32(*src.DefaultMode) & 0o777
	}
	files := make([]guestinit.File, 0, len(src.Items))
	for _, it := range src.Items {
		data, err := fieldOf(vm, it.FieldRef.FieldPath)
		if err != nil {
			return nil, err
		}
		m := mode
		if it.Mode != nil {
			m = uint32(*it.Mode) & 0o777
		}
		files = append(files, guestinit.File{Path: it.Path, Mode: m, Data: []byte(data)})
	}
	return files, nil
}

func fieldOf(vm *impv1.ImpVM, path string) (string, error) {
	switch path {
	case "metadata.name":
		return vm.Name, nil
	case "metadata.namespace":
		return vm.Namespace, nil
	case "metadata.uid":
		return string(vm.UID), nil
	case "metadata.labels":
		return formatMap(vm.Labels), nil
	case "metadata.annotations":
		return formatMap(vm.Annotations), nil
	}
	for prefix, m := range map[string]map[string]string{"metadata.labels['": vm.Labels, "metadata.annotations['": vm.Annotations} {
		if key, ok := strings.CutPrefix(path, prefix); ok {
			if key, ok := strings.CutSuffix(key, "']"); ok {
				return m[key], nil
			}
		}
	}
	return "", fmt.Errorf("unsupported fieldPath %q", path)
}

func formatMap(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%q\n", k, m[k])
	}
	return b.String()
}

// Remove removes the disks of vm's volumes from its state directory dir: its emptyDisks, and
// the nodes of its claims' devices (their data is the claims').
func Remove(dir string, vm *impv1.ImpVM) error {
	var errs []error
	for _, v := range vm.Spec.Volumes {
		if !v.Disk() {
			continue
		}
		if err := os.Remove(filepath.Join(dir, DiskFile(v.Name))); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
