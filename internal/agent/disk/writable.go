package disk

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/syscode-labs/imp/internal/guestinit"
)

// EnsureWritable creates the VM's own writable disk at path when it does not exist: an ext4
// filesystem of size bytes labelled guestinit.WritableLabel, holding the workload's
// configuration at guestinit.ConfigPath; imp-init puts the overlay's upper layer beside it. An
// existing disk is left as it is: it holds what the VM wrote.
func EnsureWritable(path string, size int64, cfg guestinit.Config, mkfs string) error {
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
	content := filepath.Join(work, "content")
	if err := os.MkdirAll(filepath.Join(content, filepath.Dir(guestinit.ConfigPath)), 0o700); err != nil {
		return err
	}
	data, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(content, guestinit.ConfigPath), data, 0o600); err != nil {
		return err
	}
	tmp := filepath.Join(work, "disk.ext4")
	out, err := exec.Command(mkfs, "-q", "-F", "-t", "ext4", "-L", guestinit.WritableLabel,
		"-d", content, tmp, fmt.Sprintf("%dM", max(size>>20, 16))).CombinedOutput()
	if err != nil {
		return fmt.Errorf("building the writable disk: %w: %s", err, out)
	}
	if err := syncFile(tmp); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
