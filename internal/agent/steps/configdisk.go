package steps

import (
	"context"

	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// ConfigDisk writes the run's workload (the image's entrypoint, cmd and env with the VM's
// overrides, its secret values resolved) on the run's configuration disk, which goes when the
// run ends. It is written at every start: each run has its own values.
type ConfigDisk struct{}

func (ConfigDisk) Name() string { return "config_disk" }

func (ConfigDisk) ShouldDo(context.Context, *vmrun.Run) (bool, error) { return true, nil }

func (ConfigDisk) Do(_ context.Context, r *vmrun.Run) error {
	cfg, err := workload(r.VM, r.Image.Secrets, r.Image.Config)
	if err != nil {
		return err
	}
	if v := r.Volumes; v != nil {
		cfg.Volumes, cfg.Mounts, cfg.Devices = v.Guest.Volumes, v.Guest.Mounts, v.Guest.Devices
	}
	if err := disk.WriteConfig(r.Path(vmrun.ConfigDisk), cfg); err != nil {
		return err
	}
	r.Config = &cfg
	return nil
}
