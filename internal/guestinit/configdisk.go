package guestinit

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The configuration disk carries one run's Config to the guest: a raw block device (no file
// system) holding ConfigMagic, the length of the JSON as a little-endian uint32, and the JSON,
// zero-padded to whole 4 KiB blocks. The agent writes a new one for every run and removes it
// when the run ends, so the workload's command, environment and secret values are current at
// every start and stay on the node no longer than the run that uses them.
const (
	ConfigMagic = "IMPCONF1"
	// MaxConfigBytes bounds the JSON of a Config (with its volumes' files, which the run's
	// Secret, at most 1 MiB, carries).
	MaxConfigBytes = 4 << 20
	configHeader   = len(ConfigMagic) + 4
	configBlock    = 4096
)

// EncodeConfigDisk returns the contents of the configuration disk holding cfg.
func EncodeConfigDisk(cfg Config) ([]byte, error) {
	data, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	if len(data) > MaxConfigBytes {
		return nil, fmt.Errorf("the workload configuration is %d bytes, more than %d", len(data), MaxConfigBytes)
	}
	n := (configHeader + len(data) + configBlock - 1) / configBlock * configBlock
	out := make([]byte, n)
	copy(out, ConfigMagic)
	binary.LittleEndian.PutUint32(out[len(ConfigMagic):], uint32(len(data)))
	copy(out[configHeader:], data)
	return out, nil
}

// ErrNotConfigDisk is returned by DecodeConfigDisk for a device that is not a configuration
// disk.
var ErrNotConfigDisk = errors.New("not an IMP configuration disk")

// DecodeConfigDisk reads the Config of a configuration disk.
func DecodeConfigDisk(r io.ReaderAt) (Config, error) {
	var cfg Config
	head := make([]byte, configHeader)
	if _, err := r.ReadAt(head, 0); err != nil {
		return cfg, fmt.Errorf("%w: %v", ErrNotConfigDisk, err)
	}
	if !bytes.Equal(head[:len(ConfigMagic)], []byte(ConfigMagic)) {
		return cfg, ErrNotConfigDisk
	}
	n := binary.LittleEndian.Uint32(head[len(ConfigMagic):])
	if n > MaxConfigBytes {
		return cfg, fmt.Errorf("the configuration disk claims %d bytes, more than %d", n, MaxConfigBytes)
	}
	data := make([]byte, n)
	if _, err := r.ReadAt(data, int64(configHeader)); err != nil {
		return cfg, fmt.Errorf("reading the configuration: %w", err)
	}
	if err := json.Unmarshal(data, &cfg); err != nil {
		return cfg, fmt.Errorf("bad workload configuration: %w", err)
	}
	if len(cfg.Argv) == 0 && !cfg.OS {
		return cfg, errors.New("bad workload configuration: no command")
	}
	if len(cfg.Argv) > 0 && cfg.OS {
		return cfg, errors.New("bad workload configuration: a command for an OS's boot")
	}
	return cfg, nil
}
