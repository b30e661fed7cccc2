// Package qemu is IMP's QEMU driver: a microVM on QEMU's microvm machine, with KVM when
// /dev/kvm works and TCG software emulation otherwise. It boots the same kernel, initramfs and
// disks as the Firecracker driver; the guest channel is a virtio-serial port instead of vsock.
package qemu

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/kvm"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// Spec is one VM as QEMU runs it.
type Spec struct {
	// Dir is the VM's state directory: sockets, console log, record.
	Dir                    string
	Kernel, Initramfs      string
	BaseDisk, WritableDisk string
	// ConfigDisk is the run's configuration disk (guestinit.EncodeConfigDisk), read-only.
	ConfigDisk string
	VCPUs      int
	MemoryMiB  int64
	// Token authenticates the guest channel; it is passed on the kernel command line.
	Token string
	// Accel is "kvm" or "tcg".
	Accel string
	// TSCkHz is the host's TSC rate; microvm under TCG needs it on the kernel command line.
	TSCkHz int
	// Tap, when set, is an open tap the VM's virtio-net device uses, with Net.MAC; QEMU gets
	// it as file descriptor 3, so the tap may live in another network namespace.
	Tap *os.File
	// Net is the guest's network configuration, put on the kernel command line.
	Net *guestinit.Net
	// Binary is the QEMU to run (default qemu-system-x86_64).
	Binary string
	// CgroupRoot, when set (cgroup.Root on a node), is where the VMM gets cgroups of its own,
	// named for the state directory, outside the agent's.
	CgroupRoot string
	// Background: the VM is a warm pool's member, restored to wait idle: its CPU weight is a
	// tenth of a running VM's, so that a pool's refill yields to the VMs at work (its handover
	// gives it the default weight, cgroup.SetWeight).
	Background bool
	// Incoming, when set, starts the VM from the state a Suspend saved in this file.
	Incoming string
	// MigrationIn starts the VM waiting for a live migration's stream (MigrateIn), its guest
	// paused once it has arrived, until ResumeIncoming: the same devices as the sending VM's,
	// which the stream fills.
	MigrationIn bool
	// MemoryImage, when set with Incoming, is the guest's memory as a snapshot holds it
	// (guestmem.Split): Start fills the VM's memory, a memfd, with it, and Incoming holds the
	// devices only, which ResumeIncoming has QEMU load (x-ignore-shared).
	MemoryImage string
	// Memory, when set with Incoming instead of MemoryImage, is the guest's memory as a
	// snapshot holds it, filled and sealed by the agent (guestmem.Cache) and shared by every
	// restore of that snapshot: QEMU maps it privately, so that what the guest writes is its
	// own copy, and loads the devices only, as for MemoryImage. Start does not close it.
	Memory *os.File
	// UID and GID, when not 0, are the VM's own uid and gid (the jail range), which QEMU runs
	// as. QEMU then reaches nothing by path: the agent opens its files and sockets and passes
	// them as descriptors; those it writes (the writable disk, the console) belong to UID.
	UID, GID int
	// Session adds the session channel's virtio-serial port (exec and port-forward). A VM
	// suspended by an agent before it must resume without it: its saved devices are fixed.
	Session bool
	// Drives are the VM's disk volumes: each opened by the agent and passed as a descriptor
	// (from driveFD on), a virtio-blk device with the drive's serial.
	Drives []vmm.Drive
}

// Files of a VM's state directory.
const (
	ConsoleLog  = "console.log"
	ChannelSock = "channel.sock"
	SessionSock = "session.sock"
	ConsoleSock = "console.sock"
	QMPSock     = "qmp.sock"
	qemuLog     = LogFile
)

// Args is QEMU's command line for s.
func (s Spec) Args() []string {
	cpu := "max"
	if s.Accel == "kvm" {
		cpu = "host"
	}
	// No pci=off: an x86 kernel built with PCI prints "PCI: Fatal: No config space access
	// function found" on the microvm machine (no PCI) whether or not it is told pci=off
	// (pci_arch_init finds no config access either way; measured): only a kernel without
	// PCI, or a machine with one, says nothing then (docs/os.md).
	cmdline := []string{"console=ttyS0", "reboot=t", "panic=-1", "quiet", guestinit.TokenParam + "=" + s.Token}
	if s.Accel == "tcg" && s.TSCkHz > 0 {
		// microvm has no PIT/HPET to calibrate the TSC against under TCG.
		cmdline = append(cmdline, fmt.Sprintf("tsc_early_khz=%d", s.TSCkHz), "tsc=reliable")
	}
	if s.Net != nil {
		cmdline = append(cmdline, s.Net.Params()...)
	}
	dir := s.Dir
	machine := "microvm"
	if s.restoresMemory() {
		// The guest's memory: a memfd the agent filled with the snapshot's (guestmem), which
		// QEMU leaves as it is when it loads the devices.
		machine += ",memory-backend=" + RAMID
	}
	args := []string{
		"-name", filepath.Base(dir),
		"-M", machine, "-accel", accel(s.Accel), "-cpu", cpu,
		"-smp", strconv.Itoa(s.VCPUs), "-m", fmt.Sprintf("%dM", s.MemoryMiB),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-kernel", fdPath(kernelFD), "-initrd", fdPath(initrdFD), "-append", strings.Join(cmdline, " "),
		"-drive", "id=base,file=" + fdPath(baseFD) + ",format=raw,if=none,readonly=on",
		"-device", "virtio-blk-device,drive=base",
		"-drive", "id=" + WritableDrive + ",file=" + fdPath(rwFD) + ",format=raw,if=none",
		"-device", "virtio-blk-device,drive=" + WritableDrive,
		"-drive", "id=config,file=" + fdPath(configFD) + ",format=raw,if=none,readonly=on",
		"-device", "virtio-blk-device,drive=config",
		// The serial console: its input from the agent's connection, if any; its output to
		// that connection and to the log, which takes it whether or not anyone is connected.
		"-chardev", fmt.Sprintf("socket,id=console,fd=%d,server=on,wait=off,logfile=%s,logappend=on", consoleSockFD, fdPath(consoleFD)),
		"-serial", "chardev:console",
		"-device", "virtio-serial-device",
		// Sockets the agent made in the state directory, passed listening.
		"-chardev", fmt.Sprintf("socket,id=channel,fd=%d,server=on,wait=off", channelFD),
		"-device", "virtserialport,chardev=channel,name=" + guestinit.ChannelName,
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d,server=on,wait=off", qmpFD),
		"-mon", "chardev=qmp,mode=control",
	}
	if s.Session {
		args = append(args,
			"-chardev", fmt.Sprintf("socket,id=session,fd=%d,server=on,wait=off", sessionFD),
			"-device", "virtserialport,chardev=session,name="+guestsession.PortName)
	}
	for i, d := range s.Drives {
		ro := ""
		if d.ReadOnly {
			ro = ",readonly=on"
		}
		if d.Own {
			ro += ",file.locking=off" // vmm.Drive.Own
		}
		if d.Direct {
			// QEMU's I/O threads, not native AIO: this QEMU (7.2) fails to open a drive
			// whose AIO context it cannot set up, and the node's fs.aio-max-nr is a limit
			// any pod can use up; native AIO also stalls QEMU while a sparse file allocates.
			ro += ",cache.direct=on"
		}
		// Through an fd set: QEMU uses the descriptors the agent opened as they are, where
		// /proc/self/fd/N would open the file again as the VM's uid (a claim's device is not
		// its to open). QEMU opens a drive read-only first, then read-write: one descriptor of
		// each mode (both read-only for a read-only drive).
		set := volumeFDSet + i
		args = append(args,
			"-add-fd", fmt.Sprintf("fd=%d,set=%d,opaque=vol-%s", driveFD+2*i, set, d.ID),
			"-add-fd", fmt.Sprintf("fd=%d,set=%d,opaque=vol-%s-ro", driveFD+2*i+1, set, d.ID),
			"-drive", fmt.Sprintf("id=%s,file.driver=%s,file.filename=/dev/fdset/%d,format=raw,if=none%s", VolumeDrive(d.ID), protocol(d), set, ro),
			"-device", fmt.Sprintf("virtio-blk-device,drive=%s,serial=%s", VolumeDrive(d.ID), d.Serial))
	}
	switch {
	case s.Incoming != "" && s.restoresMemory():
		// The run's own memfd is mapped shared, and x-ignore-shared leaves it alone; the
		// snapshot's shared memory is mapped privately (copy-on-write), and the devices' stream
		// holds no page of it to load.
		share := "on"
		if s.Memory != nil {
			share = "off"
		}
		args = append(args,
			"-object", fmt.Sprintf("memory-backend-file,id=%s,size=%dM,mem-path=%s,share=%s", RAMID, s.MemoryMiB, fdPath(memFD), share),
			"-incoming", "defer") // ResumeIncoming starts it, x-ignore-shared set
	case s.Incoming != "":
		args = append(args, "-incoming", fmt.Sprintf("fd:%d", incomingFD))
	case s.MigrationIn:
		args = append(args, "-incoming", "defer", "-S") // MigrateIn; paused until its commit
	}
	if s.Tap != nil && s.Net != nil {
		args = append(args,
			"-netdev", fmt.Sprintf("tap,id=net0,fd=%d,vhost=off", tapFD),
			"-device", "virtio-net-device,netdev=net0,mac="+s.Net.MAC)
	}
	// Confined like Firecracker's seccomp filters: no obsolete system calls, no setuid and
	// friends, no fork or exec, no scheduler or CPU affinity changes.
	return append(args, "-sandbox", Sandbox)
}

// Limits are the VMM's cgroup limits: the guest's memory plus QEMU's measured overhead
// (vmm.MemoryOverhead); threads for the vCPUs and QEMU's own, and no more (QEMU may spawn
// nothing); the vCPUs' time plus half a CPU for QEMU's I/O and emulation threads.
func (s Spec) Limits() cgroup.Limits {
	l := cgroup.Limits{
		MemoryBytes: s.MemoryMiB<<20 + vmm.MemoryOverhead("qemu", s.Accel),
		Pids:        int64(128 + 2*s.VCPUs), // the block layer's thread pool alone may reach 64
		CPUs:        float64(s.VCPUs) + 0.5,
		Weight:      cgroup.DefaultWeight,
	}
	if s.Background {
		l.Weight = BackgroundWeight
	}
	return l
}

// BackgroundWeight is the CPU weight of a warm pool member's VMM (Spec.Background).
const BackgroundWeight = cgroup.BackgroundWeight

// files opens what QEMU is given, in the order of the descriptors from 3 (see tapFD). The
// files QEMU writes become its uid's, in the agent's directory, where it can replace nothing.
func (s Spec) files(mem *os.File) ([]*os.File, error) {
	files := make([]*os.File, memFD-tapFD+1+2*len(s.Drives))
	files[tapFD-3] = s.Tap
	if mem != nil {
		m, err := dupFile(mem) // Start closes what files returns, and keeps mem for the fill
		if err != nil {
			return files, err
		}
		files[memFD-3] = m
	}
	open := func(fd int, path string, flag int) error {
		f, err := os.OpenFile(path, flag|syscall.O_NOFOLLOW, 0o600)
		if err != nil {
			return fmt.Errorf("opening %s for the VMM: %w", path, err)
		}
		files[fd-3] = f
		if s.UID != 0 && (fd == rwFD || fd == configFD || fd == consoleFD) {
			if err := f.Chown(s.UID, s.GID); err != nil {
				return fmt.Errorf("giving %s to uid %d: %w", path, s.UID, err)
			}
		}
		return nil
	}
	if s.Incoming != "" {
		if err := open(incomingFD, s.Incoming, os.O_RDONLY); err != nil {
			return files, err
		}
	}
	for _, o := range []struct {
		fd   int
		path string
		flag int
	}{
		{kernelFD, s.Kernel, os.O_RDONLY}, {initrdFD, s.Initramfs, os.O_RDONLY}, {baseFD, s.BaseDisk, os.O_RDONLY},
		{rwFD, s.WritableDisk, os.O_RDWR}, {configFD, s.ConfigDisk, os.O_RDONLY},
		{consoleFD, filepath.Join(s.Dir, ConsoleLog), os.O_WRONLY | os.O_APPEND | os.O_CREATE},
	} {
		if err := open(o.fd, o.path, o.flag); err != nil {
			return files, err
		}
	}
	for i, d := range s.Drives {
		flag := os.O_RDWR
		if d.ReadOnly {
			flag = os.O_RDONLY
		}
		var f *os.File
		var err error
		switch {
		case d.File != nil && d.Direct:
			f, err = reopen(d.File, flag|unix.O_DIRECT) // the caller's stays as it is
		case d.File != nil:
			f, err = dupFile(d.File) // the caller's stays open, Start closes this one
		case d.Direct:
			f, err = os.OpenFile(d.Path, flag|syscall.O_NOFOLLOW|unix.O_DIRECT, 0)
		default:
			f, err = os.OpenFile(d.Path, flag|syscall.O_NOFOLLOW, 0)
		}
		if err != nil {
			return files, fmt.Errorf("opening volume %s for the VMM: %w", d.ID, err)
		}
		files[driveFD+2*i-3] = f
		// Its read-only descriptor: the same file opened again by the agent.
		roFlag := os.O_RDONLY
		if d.Direct {
			roFlag |= unix.O_DIRECT
		}
		ro, err := reopen(f, roFlag)
		if err != nil {
			return files, fmt.Errorf("opening volume %s read-only for the VMM: %w", d.ID, err)
		}
		files[driveFD+2*i+1-3] = ro
		if fi, err := f.Stat(); err == nil && fi.Mode().IsRegular() && s.UID != 0 && !d.ReadOnly && d.File == nil {
			if err := f.Chown(s.UID, s.GID); err != nil { // as the writable disk: what it writes is its uid's
				return files, fmt.Errorf("giving volume %s to uid %d: %w", d.ID, s.UID, err)
			}
		}
	}
	socks := map[int]string{channelFD: ChannelSock, qmpFD: QMPSock, consoleSockFD: ConsoleSock}
	if s.Session {
		socks[sessionFD] = SessionSock
	}
	for fd, name := range socks {
		f, err := vmm.ListenUnix(filepath.Join(s.Dir, name))
		if err != nil {
			return files, err
		}
		files[fd-3] = f
	}
	return files, nil
}

// protocol is QEMU's block driver of d: host_device for a block device (the file driver takes
// regular files only, and cannot tell from an fd set's name).
func protocol(d vmm.Drive) string {
	if d.Block {
		return "host_device"
	}
	return "file"
}

// reopen opens f's file anew with flag, close-on-exec: a description of its own, whose flags
// (O_DIRECT) are not f's.
func reopen(f *os.File, flag int) (*os.File, error) {
	return os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), flag, 0)
}

// direct is drives with Direct set on each whose file or device the node opens with
// O_DIRECT (a file system that cannot, tmpfs before Linux 6.6 or FUSE, says EINVAL), but
// for files on btrfs: there a guest changing a buffer while QEMU writes it straight from
// guest memory leaves a block whose checksum fails, and reads of it fail from then on.
func direct(drives []vmm.Drive) []vmm.Drive {
	out := make([]vmm.Drive, len(drives))
	for i, d := range drives {
		var f *os.File
		var err error
		if d.File != nil {
			f, err = reopen(d.File, os.O_RDONLY|unix.O_DIRECT)
		} else {
			f, err = os.OpenFile(d.Path, os.O_RDONLY|syscall.O_NOFOLLOW|unix.O_DIRECT, 0)
		}
		d.Direct = err == nil
		if err == nil {
			var st unix.Statfs_t
			if unix.Fstatfs(int(f.Fd()), &st) != nil || st.Type == unix.BTRFS_SUPER_MAGIC {
				d.Direct = false
			}
			f.Close()
		}
		out[i] = d
	}
	return out
}

// dupFile is a new descriptor of f's open file, close-on-exec from its first instant: a VMM
// the agent starts meanwhile for another VM must not inherit it.
func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}

// kvmGroup is the group owning /dev/kvm under KVM, which a VMM of its own uid needs.
func kvmGroup(accel string) []uint32 {
	fi, err := os.Stat(kvm.Device)
	if accel != "kvm" || err != nil {
		return []uint32{}
	}
	return []uint32{fi.Sys().(*syscall.Stat_t).Gid}
}

// Sandbox is QEMU's seccomp policy for every VMM.
const Sandbox = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// The descriptors QEMU inherits, in order from 3: the VM's tap, the saved state it resumes
// from, the listening sockets of the guest channel and QMP, the kernel, the initramfs, the
// disks, the console's log, the session channel's listening socket and the console's. QEMU
// opens files by /proc/self/fd, which no directory's permissions stand in the way of; it
// creates nothing on the host.
const (
	tapFD = 3 + iota
	incomingFD
	channelFD
	qmpFD
	kernelFD
	initrdFD
	baseFD
	rwFD
	configFD
	consoleFD
	sessionFD // runs that have none keep the numbers above
	consoleSockFD
	memFD   // a restored guest's memory (guestmem)
	driveFD // the first of the disk volumes', two each (read-write, read-only)
)

// volumeFDSet is the fd set of the first disk volume, one each.
const volumeFDSet = 10

// RAMID is the guest's RAM block: the name QEMU gives microvm's default RAM, which a restore's
// memfd takes too, so that the streams of VMs of either kind load into the other.
const RAMID = "microvm.ram"

func fdPath(fd int) string { return fmt.Sprintf("/proc/self/fd/%d", fd) }

// tcgCacheMiB bounds TCG's translation cache, which would otherwise grow to 1 GiB per VM with
// the code a guest runs; vmm.MemoryOverhead counts it.
const tcgCacheMiB = 64

func accel(a string) string {
	if a == "tcg" {
		return fmt.Sprintf("tcg,tb-size=%d", tcgCacheMiB)
	}
	return a
}

// Start launches QEMU for s detached from the caller: its own session and cgroups, its standard
// streams on files, so that the caller exiting (the agent restarting, its pod being replaced)
// does not end the VM. It writes and
// returns the VM's record.
func Start(s Spec, configHash string) (*vmm.Record, error) {
	bin := s.Binary
	if bin == "" {
		bin = "qemu-system-x86_64"
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, qemuLog), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening the VMM log: %w", err)
	}
	defer logf.Close()
	mem := s.Memory
	if mem == nil && s.MemoryImage != "" {
		if mem, err = guestmem.Create(filepath.Base(s.Dir), s.MemoryMiB<<20); err != nil {
			return nil, err
		}
		defer mem.Close()
	}
	s.Drives = direct(s.Drives)
	files, err := s.files(mem)
	defer func() {
		for _, f := range files {
			if f != nil && f != s.Tap {
				f.Close()
			}
		}
	}()
	if err != nil {
		return nil, err
	}
	command := func(cg *os.File) *exec.Cmd {
		cmd := exec.Command(bin, s.Args()...)
		// Whose it is, beside its marker (vmm.Marked): the directory of the run on its node.
		cmd.Env = append(os.Environ(), vmm.DirEnv+"="+s.Dir)
		cmd.Stdout, cmd.Stderr = logf, logf
		cmd.ExtraFiles = files
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		if s.UID != 0 {
			// Its own uid and nothing else: no supplementary group, no capability. (KVM: the
			// group that owns /dev/kvm.)
			cmd.SysProcAttr.Credential = &syscall.Credential{Uid: uint32(s.UID), Gid: uint32(s.GID), Groups: kvmGroup(s.Accel)}
		} else {
			cmd.Dir = s.Dir
		}
		if cg != nil {
			cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, int(cg.Fd())
		}
		return cmd
	}
	// Its cgroups, limits in place, before it starts: where the host has the unified hierarchy
	// (cgroup v2), it starts in its cgroup there.
	var cgroups *cgroup.Set
	var unified *os.File
	if s.CgroupRoot != "" {
		if cgroups, err = cgroup.Prepare(s.CgroupRoot, filepath.Base(s.Dir), s.Limits()); err != nil {
			return nil, err
		}
		if unified = cgroups.Unified(); unified != nil {
			defer unified.Close()
		}
	}
	cmd := command(unified)
	err = cmd.Start()
	if err != nil && unified != nil {
		// A kernel before 5.7 (no CLONE_INTO_CGROUP), or a cgroup it may not start in: it
		// starts where the agent is and moves.
		unified = nil
		cmd = command(nil)
		err = cmd.Start()
	}
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	// Reap it if it exits while this process lives; after a restart the new agent's parent
	// (init or the container's subreaper) does.
	go func() { _ = cmd.Wait() }()
	failpoint.Crash("vmm-started")
	if cgroups != nil {
		if _, err := cgroups.Join(cmd.Process.Pid, unified != nil); err != nil {
			_ = cmd.Process.Kill()
			return nil, err
		}
	}
	st, err := vmm.StartTime(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		return nil, err
	}
	rec := &vmm.Record{Kind: "qemu", Pid: cmd.Process.Pid, StartTime: st, ConfigHash: configHash}
	if mem != nil {
		// The run's own memory filled while QEMU starts, and recorded only once it is whole:
		// an agent that finds the record may have QEMU load the devices on it.
		if s.Memory == nil {
			if err := s.fill(mem, cgroups); err != nil {
				_ = cmd.Process.Kill()
				return nil, err
			}
		}
		rec.IncomingFD = incomingFD
	}
	if err := vmm.WriteRecord(s.Dir, rec); err != nil {
		_ = cmd.Process.Kill()
		return nil, err
	}
	return rec, nil
}

// restoresMemory: the guest's memory is a snapshot's, given to QEMU as a memfd.
func (s Spec) restoresMemory() bool { return s.Memory != nil || s.MemoryImage != "" }

// fillTimeout bounds the fill of a restored guest's memory: a copy of at most its memory.
const fillTimeout = 2 * time.Minute

// fill fills the guest's memory mem with s.MemoryImage, in a child in the VM's cgroups.
func (s Spec) fill(mem *os.File, cgroups *cgroup.Set) error {
	img, err := os.OpenFile(s.MemoryImage, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("opening the memory image: %w", err)
	}
	defer img.Close()
	ctx, cancel := context.WithTimeout(context.Background(), fillTimeout)
	defer cancel()
	return guestmem.Fill(ctx, mem, img, func(pid int) error {
		if cgroups == nil {
			return nil
		}
		_, err := cgroups.Join(pid, false)
		return err
	})
}

// DialChannel connects to the guest channel of the VM in dir.
func DialChannel(dir string) (net.Conn, error) { return vmm.DialUnix(filepath.Join(dir, ChannelSock)) }

// DialConsole connects to the serial console of the VM in dir: what is written reaches the
// guest, and the guest's output arrives, which the caller must read (or QEMU waits for it).
// QEMU serves one connection at a time; others wait until it closes.
func DialConsole(dir string) (net.Conn, error) { return vmm.DialUnix(filepath.Join(dir, ConsoleSock)) }

// DialSession connects to the session channel of the VM in dir.
func DialSession(dir string) (net.Conn, error) { return vmm.DialUnix(filepath.Join(dir, SessionSock)) }

// LogFile is QEMU's own output in the VM's directory.
const LogFile = "qemu.log"

// CapConsole keeps the VM's console log under max bytes (vmm.CapFile).
func CapConsole(dir string, max int64) error { return vmm.CapFile(dir, ConsoleLog, max) }

// LogTail returns up to n bytes of the end of the VMM's own log, on one line.
func LogTail(dir string, n int64) string { return vmm.Tail(dir, qemuLog, n) }

// Accel returns "kvm" when this host's KVM can run QEMU guests (kvm.Check), else "tcg".
func Accel() string {
	if kvm.Check(kvm.Device) == nil {
		return "kvm"
	}
	return "tcg"
}

// TSCkHz reads the host CPU's rate from /proc/cpuinfo, in kHz (0 when unknown).
func TSCkHz() int {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "cpu MHz" {
			mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil {
				return int(mhz * 1000)
			}
		}
	}
	return 0
}

func syscallKill(pid int) error { return syscall.Kill(pid, syscall.SIGKILL) }
