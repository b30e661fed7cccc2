// Package cloudinit gives a VM that boots an OS (ImpVM spec.boot OS) its cloud-init NoCloud
// data (spec.cloudInit) on a read-only seed disk labelled cidata: a FAT32 file system with
// meta-data (instance-id, local-hostname), user-data and, when the VM gives one,
// network-config. The seed is a file of the VM's own state directory, attached to its VMM as
// a drive; never a network service a guest's process could reach (docs/os.md).
package cloudinit

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"

	diskfs "github.com/diskfs/go-diskfs"
	"github.com/diskfs/go-diskfs/disk"
	"github.com/diskfs/go-diskfs/filesystem"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

const (
	// File is the seed disk, in the run's state directory.
	File = "cidata.img"
	// Label is the file system label cloud-init's NoCloud looks for.
	Label = "cidata"
	// DriveID is the seed's drive: a name no volume of the VM can have (a volume's name is a
	// DNS label, without a dot).
	DriveID = "cidata.seed"
	// Serial is the seed drive's serial, outside imp-init's volume serials.
	Serial = "imp-cidata"
	// size is the seed's file system: FAT32's smallest (the file is sparse).
	size = 34 << 20
	// MaxUserData bounds the user data a seed takes (a Secret's value may be up to 1 MiB).
	MaxUserData = 1 << 20
)

// Data is what a seed holds.
type Data struct {
	// InstanceID is cloud-init's instance: a new one runs its per-instance modules again.
	InstanceID string
	Hostname   string
	UserData   []byte
	// NetworkData is cloud-init's network configuration; none leaves the network to IMP.
	NetworkData []byte
}

// For is the seed of vm's run: instance-id its UID and placement (a new placement, on a new
// writable disk, is a new instance; a restart on the same disk is not), local-hostname its
// name, its user data inline or from the run's Secret.
func For(vm *impv1.ImpVM, userData []byte) Data {
	ci := vm.Spec.CloudInit
	d := Data{InstanceID: string(vm.UID) + "." + strconv.FormatInt(vm.Status.Instance, 10), Hostname: vm.Name}
	if ci == nil {
		return d
	}
	d.UserData = userData
	if ci.UserDataSecretRef == nil {
		d.UserData = []byte(ci.UserData)
	}
	if ci.NetworkData != "" {
		d.NetworkData = []byte(ci.NetworkData)
	}
	return d
}

// Write makes the seed disk at path, replacing any.
func Write(path string, d Data) error {
	if len(d.UserData) > MaxUserData {
		return fmt.Errorf("the user data is %d bytes, more than %d", len(d.UserData), MaxUserData)
	}
	tmp := path + ".tmp"
	_ = os.Remove(tmp)
	img, err := diskfs.Create(tmp, size, diskfs.SectorSizeDefault)
	if err != nil {
		return fmt.Errorf("making the seed disk: %w", err)
	}
	fs, err := img.CreateFilesystem(disk.FilesystemSpec{Partition: 0, FSType: filesystem.TypeFat32, VolumeLabel: Label})
	if err != nil {
		_ = img.Close()
		return fmt.Errorf("making the seed's file system: %w", err)
	}
	meta := fmt.Sprintf("instance-id: %q\nlocal-hostname: %q\n", d.InstanceID, d.Hostname)
	files := []struct {
		name string
		data []byte
	}{{"/meta-data", []byte(meta)}, {"/user-data", d.UserData}}
	if d.NetworkData != nil {
		files = append(files, struct {
			name string
			data []byte
		}{"/network-config", d.NetworkData})
	}
	for _, f := range files {
		w, err := fs.OpenFile(f.name, os.O_CREATE|os.O_RDWR)
		if err != nil {
			_ = img.Close()
			return fmt.Errorf("writing the seed's %s: %w", f.name, err)
		}
		if _, err := w.Write(f.data); err != nil {
			_ = img.Close()
			return fmt.Errorf("writing the seed's %s: %w", f.name, err)
		}
	}
	if err := img.Close(); err != nil {
		return fmt.Errorf("closing the seed disk: %w", err)
	}
	if err := os.Chmod(tmp, 0o600); err != nil { // user data: the node's root's alone, as the VM's other files
		return err
	}
	return os.Rename(tmp, path)
}

// Seed is the start plan's step that makes the seed of a VM with spec.cloudInit and attaches
// it: made at each boot from the run's user data; a resume attaches the one its VMM had.
type Seed struct{}

func (Seed) Name() string { return "cloud_init_seed" }

func (Seed) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	if r.VM.Spec.CloudInit == nil {
		return false, nil
	}
	if r.Volumes == nil {
		return true, nil
	}
	for _, d := range r.Volumes.Drives {
		if d.ID == DriveID {
			return false, nil
		}
	}
	return true, nil
}

func (Seed) Do(_ context.Context, r *vmrun.Run) error {
	path := r.Path(File) // an OS under Firecracker never gets here (steps.OSBoot)
	if r.Image != nil {  // a boot; a resume (no image) attaches the seed its guest saw
		var userData []byte
		if r.VM.Spec.CloudInit.UserDataSecretRef != nil {
			v, ok := r.Image.Secrets.UserData()
			if !ok {
				return errors.New("cloudInit.userDataSecretRef: no user data in the run's Secret")
			}
			userData = v
		}
		if err := Write(path, For(r.VM, userData)); err != nil {
			return fmt.Errorf("cloud-init: %w", err)
		}
	} else if _, err := os.Stat(path); err != nil {
		return fmt.Errorf("cloud-init: the seed disk: %w", err)
	}
	if r.Volumes == nil {
		r.Volumes = &vmrun.Volumes{}
	}
	r.Volumes.Drives = append(r.Volumes.Drives, vmm.Drive{ID: DriveID, Path: path, Serial: Serial, ReadOnly: true, Own: true})
	return nil
}
