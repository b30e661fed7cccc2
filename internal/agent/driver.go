package agent

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

// launchSpec is one start of a VM's VMM: its run's meta, base disk, network, and, for a
// resume, the saved state.
type launchSpec struct {
	vm       *impv1.ImpVM
	dir      string
	m        *meta
	baseDisk string
	at       hostnet.Attachment
	net      *guestinit.Net
	resume   bool
	// restore is the directory, in the node's store, of the snapshot the run is restored from.
	restore string
	// drives are the run's disk volumes.
	drives []vmm.Drive
}

// driver is one kind of VMM as the agent runs it. The agent never asks which kind it has:
// each driver confines its VMM its own way (QEMU: seccomp sandbox, the VM's uid, descriptors;
// Firecracker: its jailer) and knows where its VMM keeps its channel, logs and saved state.
type driver interface {
	// start boots the VM, or, with resume, brings it back from its saved state.
	start(ctx context.Context, l launchSpec) (*vmm.Record, error)
	// saved says whether the VM in dir has a saved state to resume from.
	saved(vm *impv1.ImpVM, dir string, m *meta) bool
	// resumed finishes a resume start began, once the VMM runs.
	resumed(ctx context.Context, dir string, rec *vmm.Record) error
	// suspend saves the running VM's state and ends its VMM.
	suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, rec *vmm.Record) error
	// snapshot writes the VM's memory and device state and its writable disk into the
	// directory into, pausing a running VM for it (and returning how long) or copying a
	// suspended one's saved state; the VM runs on (or stays suspended) whatever happens.
	snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, running bool, into string, resumed func()) (time.Duration, error)
	// quit asks the VMM to end at once (the step before a signal).
	quit(ctx context.Context, uid types.UID) error
	// dial connects to the guest channel.
	dial(dir string) (net.Conn, error)
	// dialSession connects to the session channel.
	dialSession(dir string) (net.Conn, error)
	// consoleLog opens the console's log for reading.
	consoleLog(dir string) (*os.File, error)
	// openConsole opens the console's input for writing.
	openConsole(dir string) (consoleWriter, error)
	// capLogs holds every file the VM writes on the node under max bytes.
	capLogs(dir string, max int64) error
	// logTail is the end of the VMM's own log, on one line.
	logTail(dir string) string
}

// driver is the driver of a VMM kind; an unknown or empty kind (records of agents before
// Firecracker) is QEMU.
func (a *Agent) driver(kind string) driver {
	if kind == string(impv1.VMMFirecracker) {
		return firecrackerDriver{a}
	}
	return qemuDriver{a}
}

// recKind is the VMM kind of a record, "" for none.
func recKind(rec *vmm.Record) string {
	if rec == nil {
		return ""
	}
	return rec.Kind
}

type qemuDriver struct{ a *Agent }

func (d qemuDriver) start(ctx context.Context, l launchSpec) (*vmm.Record, error) {
	a, res := d.a, l.vm.Status.Resources
	spec := qemu.Spec{Dir: l.dir, Kernel: a.Opts.Kernel, Initramfs: a.Opts.Initramfs, BaseDisk: l.baseDisk,
		WritableDisk: filepath.Join(l.dir, "rw.ext4"), ConfigDisk: filepath.Join(l.dir, configDisk),
		VCPUs: int(res.VCPUs), MemoryMiB: res.Memory.Value() >> 20, Token: l.m.Token, Accel: a.Opts.Accel, TSCkHz: qemu.TSCkHz(),
		CgroupRoot: a.Opts.CgroupRoot, Tap: l.at.Tap, Net: l.net, UID: l.m.JailUID, GID: l.m.JailUID, Session: l.m.Session, Drives: l.drives}
	if l.resume {
		spec.Incoming = filepath.Join(l.dir, qemu.StateFile)
	}
	if l.restore != "" {
		spec.Incoming = filepath.Join(l.restore, snapshot.StateFile) // opened by the agent, passed as a descriptor
		if mem := filepath.Join(l.restore, snapshot.MemoryFile); regularFile(mem) {
			// The stream holds the devices only. The memory: the snapshot's, shared with its
			// other restores, or else a copy of the run's own, and the cache fills the shared
			// one for the next restore once this one's VMM runs.
			shared, err := a.memories.Get(mem, spec.MemoryMiB<<20, string(l.vm.UID))
			switch {
			case err == nil:
				defer shared.Close()
				spec.Memory = shared
			case errors.Is(err, guestmem.ErrNotCached):
				spec.MemoryImage = mem
				defer d.warm(ctx, l.vm, mem, spec.MemoryMiB<<20)
			default:
				return nil, err
			}
		}
	}
	return qemu.Start(spec, l.m.Digest)
}

// warm has the node's cache fill the shared memory of the snapshot memory image img, in the
// background, for the restores after this one, and logs what came of it.
func (d qemuDriver) warm(ctx context.Context, vm *impv1.ImpVM, img string, size int64) {
	began, log := time.Now(), ctrl.LoggerFrom(ctx).WithValues("vm", vm.Name, "memoryImage", img)
	done := d.a.memories.Warm(img, size)
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

func (d qemuDriver) snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, _ *meta, running bool, into string, resumed func()) (time.Duration, error) {
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

func (qemuDriver) saved(_ *impv1.ImpVM, dir string, _ *meta) bool {
	_, err := os.Stat(filepath.Join(dir, qemu.StateFile))
	return err == nil
}

func (qemuDriver) resumed(_ context.Context, dir string, rec *vmm.Record) error {
	if err := qemu.ResumeIncoming(dir, rec, 5*time.Minute); err != nil {
		if rec.Alive() {
			_ = qemu.Quit(dir)
		}
		return err
	}
	_ = os.Remove(filepath.Join(dir, qemu.StateFile)) // the VM runs from it no more
	return nil
}

func (qemuDriver) suspend(_ context.Context, _ *impv1.ImpVM, dir string, _ *meta, _ *vmm.Record) error {
	return qemu.Suspend(dir, 5*time.Minute)
}

func (d qemuDriver) quit(_ context.Context, uid types.UID) error { return qemu.Quit(d.a.vmDir(uid)) }

func (qemuDriver) dial(dir string) (net.Conn, error) { return qemu.DialChannel(dir) }

func (qemuDriver) dialSession(dir string) (net.Conn, error) { return qemu.DialSession(dir) }

func (qemuDriver) consoleLog(dir string) (*os.File, error) {
	return vmm.OpenIn(dir, qemu.ConsoleLog, os.O_RDONLY)
}

// openConsole connects to QEMU's console socket, reading and dropping the guest's output,
// which reaches the log anyway: QEMU waits for a connection that is not read.
func (qemuDriver) openConsole(dir string) (consoleWriter, error) {
	c, err := qemu.DialConsole(dir)
	if err != nil {
		return nil, err
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
	return c, nil
}

func (qemuDriver) capLogs(dir string, max int64) error {
	return errors.Join(qemu.CapConsole(dir, max), vmm.CapFile(dir, qemu.LogFile, max))
}

func (qemuDriver) logTail(dir string) string { return qemu.LogTail(dir, 300) }

type firecrackerDriver struct{ a *Agent }

// spec is the VM as the Firecracker driver runs it.
func (d firecrackerDriver) spec(vm *impv1.ImpVM, dir string, m *meta, base string, at hostnet.Attachment, gnet *guestinit.Net) firecracker.Spec {
	a, res := d.a, vm.Status.Resources
	s := firecracker.Spec{ID: string(vm.UID), Dir: dir, Firecracker: a.Opts.Firecracker, Jailer: a.Opts.Jailer,
		UID: m.JailUID, GID: m.JailUID, ChrootBase: a.jailBase(), NetNS: a.Opts.NetNS, CgroupVersion: cgroup.Version(a.Opts.CgroupRoot),
		Kernel: a.Opts.Kernel, Initramfs: a.Opts.Initramfs, BaseDisk: base, WritableDisk: filepath.Join(dir, "rw.ext4"), ConfigDisk: filepath.Join(dir, configDisk),
		Token: m.Token}
	if res != nil {
		s.VCPUs, s.MemoryMiB = int(res.VCPUs), res.Memory.Value()>>20
	}
	if gnet != nil {
		// The jailer joins the network's namespace, where Firecracker opens the tap by name.
		s.Tap, s.Net, s.NetNS = hostnet.TapName(string(vm.UID)), gnet, at.NetNS
	}
	return s
}

// start runs the VM under Firecracker's jailer: booted, or resumed from its snapshot.
func (d firecrackerDriver) start(ctx context.Context, l launchSpec) (*vmm.Record, error) {
	s := d.spec(l.vm, l.dir, l.m, l.baseDisk, l.at, l.net)
	s.Drives = l.drives
	if l.at.Tap != nil {
		// The jailed Firecracker, an unprivileged uid, opens the persistent tap by name.
		if err := hostnet.SetOwner(l.at.Tap, l.m.JailUID); err != nil {
			return nil, err
		}
	}
	// The console where every driver's is, for kubectl imp logs.
	console := filepath.Join(l.dir, qemu.ConsoleLog)
	if err := os.Remove(console); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	if err := os.Symlink(s.ConsoleLog(), console); err != nil {
		return nil, err
	}
	if l.resume {
		return firecracker.ResumeSnapshot(ctx, s, l.m.Digest)
	}
	if l.restore != "" {
		return firecracker.RestoreSnapshot(ctx, s, filepath.Join(l.restore, firecracker.SnapshotStateFile), filepath.Join(l.restore, firecracker.SnapshotMemFile), l.m.Digest)
	}
	return firecracker.Start(ctx, s, l.m.Digest)
}

func (d firecrackerDriver) saved(vm *impv1.ImpVM, dir string, m *meta) bool {
	return firecracker.Snapshotted(d.spec(vm, dir, m, "", hostnet.Attachment{}, nil))
}

// resumed: Firecracker's snapshot load resumed the guest already.
func (firecrackerDriver) resumed(context.Context, string, *vmm.Record) error { return nil }

func (d firecrackerDriver) suspend(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, rec *vmm.Record) error {
	return firecracker.Suspend(ctx, d.spec(vm, dir, m, "", hostnet.Attachment{}, nil), rec)
}

// snapshot: a running VM's state and memory written by Firecracker into its jail, then moved out
// into the snapshot; a suspended VM's (its jail's suspension files) copied out.
func (d firecrackerDriver) snapshot(ctx context.Context, vm *impv1.ImpVM, dir string, m *meta, running bool, into string, resumed func()) (time.Duration, error) {
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
func (d firecrackerDriver) quit(ctx context.Context, uid types.UID) error {
	c := firecracker.NewJailClient(d.a.jailRoot(uid))
	return c.Do(ctx, "PUT", "/actions", firecracker.Action{ActionType: "SendCtrlAltDel"}, nil)
}

func (d firecrackerDriver) dial(dir string) (net.Conn, error) {
	return firecracker.DialChannel(d.a.jailRoot(types.UID(filepath.Base(dir))))
}

func (d firecrackerDriver) dialSession(dir string) (net.Conn, error) {
	return firecracker.DialSession(d.a.jailRoot(types.UID(filepath.Base(dir))))
}

// consoleLog: the file in the jail, where the VMM could have replaced it, opened through
// vmm.OpenIn.
func (d firecrackerDriver) consoleLog(dir string) (*os.File, error) {
	return vmm.OpenIn(d.a.jailRoot(types.UID(filepath.Base(dir))), firecracker.ConsoleFile, os.O_RDONLY)
}

// openConsole opens Firecracker's stdin, a FIFO of the VM's directory, outside the jail.
func (firecrackerDriver) openConsole(dir string) (consoleWriter, error) {
	return firecracker.OpenConsole(dir)
}

// capLogs: the files in the jail, where the VMM could have replaced them, are opened through
// vmm.OpenIn like the others.
func (d firecrackerDriver) capLogs(dir string, max int64) error {
	jail := d.a.jailRoot(types.UID(filepath.Base(dir)))
	return errors.Join(vmm.CapFile(jail, firecracker.ConsoleFile, max), vmm.CapFile(jail, firecracker.LogFile, max),
		vmm.CapFile(jail, firecracker.MetricsFile, max), vmm.CapFile(dir, firecracker.JailerLog, max))
}

func (d firecrackerDriver) logTail(dir string) string {
	return vmm.Tail(d.a.jailRoot(types.UID(filepath.Base(dir))), firecracker.LogFile, 300)
}

// regularFile says whether path is a regular file (not followed if a link).
func regularFile(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().IsRegular()
}
