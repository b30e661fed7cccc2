package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// EnsureWritable creates the VM's own writable disk at path when it does not exist: an empty
// ext4 file system of size bytes labelled guestinit.WritableLabel, where imp-init keeps the
// overlay's upper layer. An existing disk is left as it is: it holds what the VM wrote.
func EnsureWritable(path string, size int64, mkfs string) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if mkfs == "" {
		mkfs = "mkfs.ext4"
	}
	work, err := os.MkdirTemp(filepath.Dir(path), ".writable-")
	if err != nil {
		return fmt.Errorf("creating a build directory: %w", err)
	}
	defer os.RemoveAll(work)
	tmp := filepath.Join(work, "disk.ext4")
	out, err := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-L", guestinit.WritableLabel,
		tmp, fmt.Sprintf("%dM", max(size>>20, 16))).CombinedOutput()
	if err != nil {
		return fmt.Errorf("building the writable disk: %w: %s", err, out)
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	return os.Rename(tmp, path)
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
