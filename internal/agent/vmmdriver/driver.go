// Package vmmdriver runs VMMs for the agent: which kinds the node offers (probed), the one a VM
// gets, and for each kind a Driver that starts, resumes, suspends, snapshots and stops its VMM,
// confined its own way (QEMU: seccomp sandbox, the VM's uid, descriptors; Firecracker: its
// jailer, a jail root per VM), and knows where its VMM keeps its channel, console and logs. It
// owns the jails and the jail uids: one uid per VM of the node, given under its own lock.
package vmmdriver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/hostnet"
	"github.com/syscode-labs/imp/internal/agent/snapshot"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/qemu"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// Launch is one start of a VM's VMM: its run's meta, base disk, network, and, for a
// resume, the saved state.
type Launch struct {
	VM       *impv1.ImpVM
	Dir      string
	Meta     *vmrun.Meta
	BaseDisk string
	// Attachment and Net are the run's tap and the guest's network (none without a network).
	Attachment hostnet.Attachment
	Net        *guestinit.Net
	Resume     bool
	// Incoming: the VMM waits for a migration's state (QEMU -incoming defer, paused).
	Incoming bool
	// Restore is the directory, in the node's store, of the snapshot the run is restored from.
	Restore string
	// Drives are the run's disk volumes.
	Drives []vmm.Drive
}

// Driver is one kind of VMM as the agent runs it. The agent never asks which kind it has:
// each driver confines its VMM its own way (QEMU: seccomp sandbox, the VM's uid, descriptors;
// Firecracker: its jailer) and knows where its VMM keeps its channel, logs and saved state.
type Driver interface {
	// Start boots the VM, or, with resume, brings it back from its saved state.
	Start(ctx context.Context, l Launch) (*vmm.Record, error)
	// Saved says whether the VM in dir has a saved state to resume from.
	Saved(vm *impv1.ImpVM, dir string, m *vmrun.Meta) bool
	// Resumed finishes a resume start began, once the VMM runs.
	Resumed(ctx context.Context, dir string, rec *vmm.Record) error
	// Suspend saves the running VM's state and ends its VMM.
	Suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error
	// Snapshot writes the VM's memory and device state and its writable disk into the
	// directory into, pausing a running VM for it (and returning how long) or copying a
	// suspended one's saved state; the VM runs on (or stays suspended) whatever happens.
	Snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, running bool, into string, resumed func()) (time.Duration, error)
	// Quit asks the VMM to end at once (the step before a signal).
	Quit(ctx context.Context, uid types.UID) error
	// Dial connects to the guest channel.
	Dial(dir string) (net.Conn, error)
	// DialSession connects to the session channel.
	DialSession(dir string) (net.Conn, error)
	// ConsoleLog opens the console's log for reading.
	ConsoleLog(dir string) (*os.File, error)
	// OpenConsole opens the console's input for writing.
	OpenConsole(dir string) (ConsoleWriter, error)
	// CapLogs holds every file the VM writes on the node under max bytes.
	CapLogs(dir string, max int64) error
	// LogTail is the end of the VMM's own log, on one line.
	LogTail(dir string) string
}

// For is the driver of a VMM kind; an unknown or empty kind (records of agents before
// Firecracker) is QEMU.
func (d *Drivers) For(kind string) Driver {
	if kind == string(impv1.VMMFirecracker) {
		return firecrackerDriver{d}
	}
	return qemuDriver{d}
}

// RecKind is the VMM kind of a record, "" for none.
func RecKind(rec *vmm.Record) string {
	if rec == nil {
		return ""
	}
	return rec.Kind
}

type qemuDriver struct{ d *Drivers }

func (d qemuDriver) Start(ctx context.Context, l Launch) (*vmm.Record, error) {
	c, res := d.d.cfg, l.VM.Status.Resources
	spec := qemu.Spec{Dir: l.Dir, Kernel: c.Kernel, Initramfs: c.Initramfs, BaseDisk: l.BaseDisk,
		WritableDisk: filepath.Join(l.Dir, "rw.ext4"), ConfigDisk: filepath.Join(l.Dir, vmrun.ConfigDisk),
		VCPUs: int(res.VCPUs), MemoryMiB: res.Memory.Value() >> 20, Token: l.Meta.Token, Accel: c.Accel, TSCkHz: qemu.TSCkHz(),
		CgroupRoot: c.CgroupRoot, Background: impv1.WarmPoolOf(l.VM) != "", Tap: l.Attachment.Tap, Net: l.Net, UID: l.Meta.JailUID, GID: l.Meta.JailUID, Session: l.Meta.Session, Drives: l.Drives}
	if l.Resume {
		spec.Incoming = filepath.Join(l.Dir, qemu.StateFile)
	}
	spec.MigrationIn = l.Incoming
	if l.Restore != "" {
		spec.Incoming = filepath.Join(l.Restore, snapshot.StateFile) // opened by the agent, passed as a descriptor
		if mem := filepath.Join(l.Restore, snapshot.MemoryFile); regularFile(mem) {
			// The stream holds the devices only. The memory: the snapshot's, shared with its
			// other restores, or else a copy of the run's own, and the cache fills the shared
			// one for the next restore once this one's VMM runs.
			shared, err := c.Memories.Get(mem, spec.MemoryMiB<<20, string(l.VM.HostUID()))
			switch {
			case err == nil:
				defer shared.Close()
				spec.Memory = shared
			case errors.Is(err, guestmem.ErrNotCached):
				spec.MemoryImage = mem
				defer d.warm(ctx, l.VM, mem, spec.MemoryMiB<<20)
			default:
				return nil, err
			}
		}
	}
	return qemu.Start(spec, l.Meta.Digest)
}

// warm has the node's cache fill the shared memory of the snapshot memory image img, in the
// background, for the restores after this one, and logs what came of it.
func (d qemuDriver) warm(ctx context.Context, vm *impv1.ImpVM, img string, size int64) {
	began, log := time.Now(), ctrl.LoggerFrom(ctx).WithValues("vm", vm.Name, "memoryImage", img)
	done := d.d.cfg.Memories.Warm(img, size)
	go func() {
		switch err := <-done; {
		case err == nil:
			log.Info("the snapshot's memory is cached: its next restores share it", "took", time.Since(began).Round(time.Millisecond))
		case errors.Is(err, guestmem.ErrNotCached):
		default:
			log.Error(err, "caching the snapshot's memory for its restores")
		}
	}()
}

func (d qemuDriver) Snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, _ *vmrun.Meta, running bool, into string, resumed func()) (time.Duration, error) {
	disk := func() error {
		return snapshot.CopyDisk(filepath.Join(dir, vmrun.WritableDisk), filepath.Join(into, snapshot.DiskFile))
	}
	var pause time.Duration
	if !running {
		if err := errors.Join(snapshot.CopyDisk(filepath.Join(dir, qemu.StateFile), filepath.Join(into, snapshot.StateFile)), disk()); err != nil {
			return 0, err
		}
	} else {
		state, err := os.OpenFile(filepath.Join(into, snapshot.StateFile), os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return 0, fmt.Errorf("creating the snapshot's state file: %w", err)
		}
		pause, err = qemu.Snapshot(dir, state, disk, 5*time.Minute)
		resumed() // the guest runs on, its snapshot's memory split from here
		state.Close()
		if err != nil {
			return pause, err
		}
	}
	d.splitMemory(ctx, vm, into)
	return pause, nil
}

// splitMemory makes the guest's memory in the snapshot in into a file of its own beside the
// devices' stream (guestmem.Split), once the guest runs on: a restore then fills its memory
// from the file rather than having QEMU stream it. A stream it cannot split stays as it is,
// and restores as it is.
func (qemuDriver) splitMemory(ctx context.Context, vm *impv1.ImpVM, into string) {
	state, devices := filepath.Join(into, snapshot.StateFile), filepath.Join(into, snapshot.StateFile+".devices")
	mib := vm.Status.Resources.Memory.Value() >> 20 // as QEMU runs it (start)
	err := guestmem.Split(state, devices, filepath.Join(into, snapshot.MemoryFile), qemu.RAMID, mib<<20)
	if err == nil {
		err = os.Rename(devices, state)
	}
	if err != nil {
		_ = os.Remove(devices)
		_ = os.Remove(filepath.Join(into, snapshot.MemoryFile))
		ctrl.LoggerFrom(ctx).Info("the snapshot keeps its memory in its stream", "vm", vm.Name, "reason", err.Error())
	}
}

func (qemuDriver) Saved(_ *impv1.ImpVM, dir string, _ *vmrun.Meta) bool {
	_, err := os.Stat(filepath.Join(dir, qemu.StateFile))
	return err == nil
}

func (qemuDriver) Resumed(_ context.Context, dir string, rec *vmm.Record) error {
	if err := qemu.ResumeIncoming(dir, rec, 5*time.Minute); err != nil {
		if rec.Alive() {
			_ = qemu.Quit(dir)
		}
		return err
	}
	_ = os.Remove(filepath.Join(dir, qemu.StateFile)) // the VM runs from it no more
	return nil
}

func (qemuDriver) Suspend(_ context.Context, _ *impv1.ImpVM, dir string, _ *vmrun.Meta, _ *vmm.Record) error {
	return qemu.Suspend(dir, 5*time.Minute)
}

func (d qemuDriver) Quit(_ context.Context, uid types.UID) error { return qemu.Quit(d.d.VMDir(uid)) }

func (qemuDriver) Dial(dir string) (net.Conn, error) { return qemu.DialChannel(dir) }

func (qemuDriver) DialSession(dir string) (net.Conn, error) { return qemu.DialSession(dir) }

func (qemuDriver) ConsoleLog(dir string) (*os.File, error) {
	return vmm.OpenIn(dir, qemu.ConsoleLog, os.O_RDONLY)
}

// openConsole connects to QEMU's console socket, reading and dropping the guest's output,
// which reaches the log anyway: QEMU waits for a connection that is not read.
func (qemuDriver) OpenConsole(dir string) (ConsoleWriter, error) {
	c, err := qemu.DialConsole(dir)
	if err != nil {
		return nil, err
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
	return c, nil
}

func (qemuDriver) CapLogs(dir string, max int64) error {
	return errors.Join(qemu.CapConsole(dir, max), vmm.CapFile(dir, qemu.LogFile, max))
}

func (qemuDriver) LogTail(dir string) string { return qemu.LogTail(dir, 300) }

type firecrackerDriver struct{ d *Drivers }

// spec is the VM as the Firecracker driver runs it.
func (d firecrackerDriver) spec(vm *impv1.ImpVM, dir string, m *vmrun.Meta, base string, at hostnet.Attachment, gnet *guestinit.Net) firecracker.Spec {
	c, res := d.d.cfg, vm.Status.Resources
	s := firecracker.Spec{ID: string(vm.HostUID()), Dir: dir, Firecracker: c.Firecracker, Jailer: c.Jailer,
		UID: m.JailUID, GID: m.JailUID, ChrootBase: d.d.JailBase(), NetNS: c.NetNS, CgroupVersion: cgroup.Version(c.CgroupRoot),
		Kernel: c.Kernel, Initramfs: c.Initramfs, BaseDisk: base, WritableDisk: filepath.Join(dir, "rw.ext4"), ConfigDisk: filepath.Join(dir, vmrun.ConfigDisk),
		Token: m.Token}
	if impv1.WarmPoolOf(vm) != "" {
		s.Weight = cgroup.BackgroundWeight // the handover's foreground step gives it a VM's
	}
	if res != nil {
		s.VCPUs, s.MemoryMiB = int(res.VCPUs), res.Memory.Value()>>20
	}
	if gnet != nil {
		// The jailer joins the network's namespace, where Firecracker opens the tap by name.
		s.Tap, s.Net, s.NetNS = hostnet.TapName(string(vm.HostUID())), gnet, at.NetNS
	}
	return s
}

// start runs the VM under Firecracker's jailer: booted, or resumed from its snapshot.
func (d firecrackerDriver) Start(ctx context.Context, l Launch) (*vmm.Record, error) {
	if l.Incoming {
		return nil, errors.New("a migration to a Firecracker VM is not built yet (docs/migration.md)")
	}
	s := d.spec(l.VM, l.Dir, l.Meta, l.BaseDisk, l.Attachment, l.Net)
	s.Drives = l.Drives
	if l.Attachment.Tap != nil {
		// The jailed Firecracker, an unprivileged uid, opens the persistent tap by name, and
		// only once the agent let go of it: a tap that is not multi-queue takes one descriptor
		// (TUNSETIFF on a held one is EBUSY, and Firecracker refuses the interface).
		if err := hostnet.SetOwner(l.Attachment.Tap, l.Meta.JailUID); err != nil {
			return nil, err
		}
		if err := l.Attachment.Tap.Close(); err != nil {
			return nil, fmt.Errorf("letting go of the tap for Firecracker: %w", err)
		}
	}
	// The console where every driver's is, for kubectl imp logs.
	console := filepath.Join(l.Dir, qemu.ConsoleLog)
	if err := os.Remove(console); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	if err := os.Symlink(s.ConsoleLog(), console); err != nil {
		return nil, err
	}
	if l.Resume {
		return firecracker.ResumeSnapshot(ctx, s, l.Meta.Digest)
	}
	if l.Restore != "" {
		return firecracker.RestoreSnapshot(ctx, s, filepath.Join(l.Restore, firecracker.SnapshotStateFile), filepath.Join(l.Restore, firecracker.SnapshotMemFile), l.Meta.Digest)
	}
	return firecracker.Start(ctx, s, l.Meta.Digest)
}

func (d firecrackerDriver) Saved(vm *impv1.ImpVM, dir string, m *vmrun.Meta) bool {
	return firecracker.Snapshotted(d.spec(vm, dir, m, "", hostnet.Attachment{}, nil))
}

// resumed: Firecracker's snapshot load resumed the guest already.
func (firecrackerDriver) Resumed(context.Context, string, *vmm.Record) error { return nil }

func (d firecrackerDriver) Suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, rec *vmm.Record) error {
	return firecracker.Suspend(ctx, d.spec(vm, dir, m, "", hostnet.Attachment{}, nil), rec)
}

// snapshot: a running VM's state and memory written by Firecracker into its jail, then moved out
// into the snapshot; a suspended VM's (its jail's suspension files) copied out.
func (d firecrackerDriver) Snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, m *vmrun.Meta, running bool, into string, resumed func()) (time.Duration, error) {
	s := d.spec(vm, dir, m, "", hostnet.Attachment{}, nil)
	disk := func() error {
		return snapshot.CopyDisk(filepath.Join(dir, vmrun.WritableDisk), filepath.Join(into, snapshot.DiskFile))
	}
	if !running {
		return 0, errors.Join(firecracker.CopySuspension(s, into), disk())
	}
	return firecracker.TakeSnapshot(ctx, s, into, disk, resumed)
}

// quit sends Ctrl-Alt-Del, on which Firecracker exits with the guest's reset.
func (d firecrackerDriver) Quit(ctx context.Context, uid types.UID) error {
	c := firecracker.NewJailClient(d.d.JailRoot(uid))
	return c.Do(ctx, "PUT", "/actions", firecracker.Action{ActionType: "SendCtrlAltDel"}, nil)
}

func (d firecrackerDriver) Dial(dir string) (net.Conn, error) {
	return firecracker.DialChannel(d.d.JailRoot(types.UID(filepath.Base(dir))))
}

func (d firecrackerDriver) DialSession(dir string) (net.Conn, error) {
	return firecracker.DialSession(d.d.JailRoot(types.UID(filepath.Base(dir))))
}

// consoleLog: the file in the jail, where the VMM could have replaced it, opened through
// vmm.OpenIn.
func (d firecrackerDriver) ConsoleLog(dir string) (*os.File, error) {
	return vmm.OpenIn(d.d.JailRoot(types.UID(filepath.Base(dir))), firecracker.ConsoleFile, os.O_RDONLY)
}

// openConsole opens Firecracker's stdin, a FIFO of the VM's directory, outside the jail.
func (firecrackerDriver) OpenConsole(dir string) (ConsoleWriter, error) {
	return firecracker.OpenConsole(dir)
}

// capLogs: the files in the jail, where the VMM could have replaced them, are opened through
// vmm.OpenIn like the others.
func (d firecrackerDriver) CapLogs(dir string, max int64) error {
	jail := d.d.JailRoot(types.UID(filepath.Base(dir)))
	return errors.Join(vmm.CapFile(jail, firecracker.ConsoleFile, max), vmm.CapFile(jail, firecracker.LogFile, max),
		vmm.CapFile(jail, firecracker.MetricsFile, max), vmm.CapFile(dir, firecracker.JailerLog, max))
}

func (d firecrackerDriver) LogTail(dir string) string {
	return vmm.Tail(d.d.JailRoot(types.UID(filepath.Base(dir))), firecracker.LogFile, 300)
}

// regularFile says whether path is a regular file (not followed if a link).
func regularFile(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().IsRegular()
}
