package vmmdriver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/preflight"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
)

// Config is what the drivers run VMMs with: the node's files and settings (agent.Options).
type Config struct {
	NodeName string
	// StateDir holds vms/<uid>/ (each VM's state) and jail/ (Firecracker's jails).
	StateDir          string
	Kernel, Initramfs string
	// Accel is QEMU's accelerator (kvm or tcg).
	Accel string
	// CgroupRoot is where VMMs get cgroups of their own; empty leaves them in the agent's.
	CgroupRoot string
	// NetNS is the network namespace of the node's VM networking (empty: the agent's).
	NetNS                          string
	KVMDevice, Firecracker, Jailer string
	// VMMs, when set, are the VMMs the node offers, best first, instead of what probing finds.
	VMMs []impv1.VMMKind
	// JailUIDBase is the first of the 65536 uids VMMs run as, one per VM (default 300000).
	JailUIDBase int
	// Memories is the node's cache of snapshots' memory that QEMU restores share; nil: each
	// restore copies.
	Memories *guestmem.Cache
}

// Drivers are the node's VMM drivers, the kinds it offers, and its jails.
type Drivers struct {
	cfg  Config
	caps []impv1.VMMCapability // what the node runs, best first

	// mu serializes the allocation of jail uids with the meta writes that record them (Record).
	mu sync.Mutex
}

// Jail uids: each Firecracker VM of a node runs as its own uid (and gid) from this range.
const (
	defaultJailUIDBase = 300000
	jailUIDCount       = 65536
)

// New probes what the node runs (Probe) and returns its drivers.
func New(ctx context.Context, cfg Config) *Drivers {
	if cfg.KVMDevice == "" {
		cfg.KVMDevice = kvm.Device
	}
	if cfg.JailUIDBase == 0 {
		cfg.JailUIDBase = defaultJailUIDBase
	}
	d := &Drivers{cfg: cfg}
	d.caps = Probe(ctx, cfg)
	return d
}

// Capabilities are the VMMs the node runs, best first.
func (d *Drivers) Capabilities() []impv1.VMMCapability { return d.caps }

// Probe lists the VMMs a node with cfg can run, best first: firecracker when KVM works and
// firecracker and its jailer run at a supported version; qemu always (KVM or TCG). cfg.VMMs,
// when set, is taken as it is. Each says what one of its VMM processes holds beyond its guest.
func Probe(ctx context.Context, cfg Config) []impv1.VMMCapability {
	caps := findVMMs(ctx, cfg)
	for i := range caps {
		caps[i].MemoryOverhead = resource.NewQuantity(vmm.MemoryOverhead(string(caps[i].Kind), caps[i].Acceleration), resource.BinarySI)
	}
	return caps
}

func findVMMs(ctx context.Context, cfg Config) []impv1.VMMCapability {
	qemuCap := impv1.VMMCapability{Kind: impv1.VMMQEMU, Acceleration: cfg.Accel, Version: qemuVersion(), GuestCPU: guestCPU(cfg.Accel)}
	if len(cfg.VMMs) > 0 {
		var caps []impv1.VMMCapability
		for _, k := range cfg.VMMs {
			if k == impv1.VMMFirecracker {
				caps = append(caps, impv1.VMMCapability{Kind: k, Acceleration: "kvm", GuestCPU: guestCPU("kvm")})
			} else {
				caps = append(caps, qemuCap)
			}
		}
		return caps
	}
	caps := []impv1.VMMCapability{qemuCap}
	if kvm.Check(cfg.KVMDevice) != nil {
		return caps
	}
	v, err := preflight.FirecrackerVersion(ctx, cfg.Firecracker)
	if err != nil || !preflight.Supported(v) {
		return caps
	}
	if jv, err := preflight.FirecrackerVersion(ctx, cfg.Jailer); err != nil || jv != v {
		return caps
	}
	return append([]impv1.VMMCapability{{Kind: impv1.VMMFirecracker, Acceleration: "kvm", Version: v, GuestCPU: guestCPU("kvm")}}, caps...)
}

// guestCPU names the CPU a VMM with accel gives its guests here (VMMCapability.GuestCPU).
func guestCPU(accel string) string {
	if accel == "tcg" {
		return "tcg:max" // qemu.Spec.Args: -cpu max, emulated
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "" // unknown: equal only to another unknown, an agent of before the field
	}
	return "host:" + snapshot.CPU(string(cpuinfo))
}

func qemuVersion() string {
	out, err := exec.Command("qemu-system-x86_64", "--version").Output()
	if err != nil {
		return ""
	}
	first, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimPrefix(first, "QEMU emulator version ")
}

// ChooseVMM picks the VMM of a VM: the one it asks for, else the node's best.
func (d *Drivers) ChooseVMM(vm *impv1.ImpVM) (impv1.VMMKind, error) {
	want := vm.Spec.VMM
	for _, c := range d.caps {
		if want == "" || c.Kind == want {
			return c.Kind, nil
		}
	}
	return "", fmt.Errorf("the VM asks for VMM %s, which node %s does not offer", want, d.cfg.NodeName)
}

// VMDir is the state directory of the VM with uid.
func (d *Drivers) VMDir(uid types.UID) string {
	return filepath.Join(d.cfg.StateDir, "vms", string(uid))
}

// JailBase is the directory of the node's Firecracker jails.
func (d *Drivers) JailBase() string { return filepath.Join(d.cfg.StateDir, "jail") }

// JailRoot is the root of the VM's Firecracker jail, which its VMM owns.
func (d *Drivers) JailRoot(uid types.UID) string { return JailRoot(d.cfg, uid) }

// JailRoot is the root of the Firecracker jail of the VM with uid on a node with cfg.
func JailRoot(cfg Config, uid types.UID) string {
	return filepath.Join(firecracker.JailDir(filepath.Join(cfg.StateDir, "jail"), cfg.Firecracker, string(uid)), "root")
}

// Record gives the run of meta m its VM's jail uid, the one recorded for the VM or else the
// lowest no other VM of the node holds, and writes m into dir: under the drivers' lock, so that
// two starts never take one uid.
func (d *Drivers) Record(dir string, m *vmrun.Meta) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	uid, err := d.allocJailUID(m.HostUID())
	if err != nil {
		return err
	}
	m.JailUID = uid
	return vmrun.WriteMeta(dir, m)
}

func (d *Drivers) allocJailUID(uid types.UID) (int, error) {
	held := map[int]bool{}
	dirs, _ := filepath.Glob(filepath.Join(d.cfg.StateDir, "vms", "*"))
	for _, dir := range dirs {
		if m, err := vmrun.ReadMeta(dir); err == nil && m.JailUID != 0 {
			if m.HostUID() == uid {
				return m.JailUID, nil
			}
			held[m.JailUID] = true
		}
	}
	base := d.cfg.JailUIDBase
	for u := base; u < base+jailUIDCount; u++ {
		if !held[u] {
			return u, nil
		}
	}
	return 0, fmt.Errorf("all %d jail uids from %d are in use", jailUIDCount, base)
}

// RemoveJail removes a VM's Firecracker jail, if it has one.
func (d *Drivers) RemoveJail(uid types.UID) error {
	if d.cfg.Firecracker == "" {
		return nil
	}
	return os.RemoveAll(firecracker.JailDir(d.JailBase(), d.cfg.Firecracker, string(uid)))
}

// EndRun removes what only the VM's current run needed, its VMM gone: its configuration disk
// (which holds the workload's secret values) and a suspension's saved state (a run that ended
// is never resumed, and placement no longer counts its memory), in the VM's directory and in
// its jail.
func (d *Drivers) EndRun(uid types.UID) error {
	var err error
	for _, f := range []string{vmrun.ConfigDisk, qemu.StateFile} {
		if rerr := os.Remove(filepath.Join(d.VMDir(uid), f)); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
			err = errors.Join(err, rerr)
		}
	}
	if d.cfg.Firecracker != "" {
		err = errors.Join(err, firecracker.RemoveConfig(d.JailRoot(uid)), firecracker.RemoveSnapshot(d.JailRoot(uid)))
	}
	return err
}

// Pause pauses the running VM kept under uid (a warm pool's idle member); Continue runs it on.
func (d *Drivers) Pause(ctx context.Context, uid types.UID, rec *vmm.Record) error {
	if rec.Kind == string(impv1.VMMFirecracker) {
		return firecracker.PauseIn(ctx, d.JailRoot(uid))
	}
	return qemu.Pause(d.VMDir(uid))
}

// Continue runs on a VM a snapshot left paused (its taker stopped before it ran it on).
func (d *Drivers) Continue(ctx context.Context, uid types.UID, rec *vmm.Record) error {
	if rec.Kind == string(impv1.VMMFirecracker) {
		return firecracker.Continue(ctx, d.JailRoot(uid))
	}
	return qemu.Continue(d.VMDir(uid))
}

// ConsoleWriter is a serial console's input as a driver opens it.
type ConsoleWriter interface {
	io.WriteCloser
	SetWriteDeadline(time.Time) error
}
