package steps

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// StateDir makes the VM's state directory, private to the agent, and voids an old
// suspension's saved state there: a run that boots does not resume.
type StateDir struct{}

func (StateDir) Name() string { return "state_dir" }

func (StateDir) ShouldDo(_ context.Context, r *vmrun.Run) (bool, error) {
	if _, err := os.Stat(r.Dir); errors.Is(err, fs.ErrNotExist) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	_, err := os.Lstat(r.Path(qemu.StateFile))
	return err == nil, nil
}

func (StateDir) Do(_ context.Context, r *vmrun.Run) error {
	if err := os.MkdirAll(r.Dir, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", r.Dir, err)
	}
	if err := os.Remove(r.Path(qemu.StateFile)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing an old suspension's state: %w", err)
	}
	return nil
}
