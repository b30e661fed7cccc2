// Package firecracker is IMP's Firecracker driver: the VMM runs under Firecracker's jailer
// (own uid and gid, a chroot holding only the VM's kernel, initramfs and disks, cgroup limits,
// the node's or a given network namespace, in a session of its own so it outlives the agent) and is
// configured over its API socket. Disks, initramfs, imp-init, network and records are the same
// as the qemu driver's; the guest channel is vsock instead of virtio-serial.
package firecracker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/guestsession"
	"golang.org/x/sys/unix"
)

// Paths inside the jail, as the jailed Firecracker sees them.
const (
	jailKernel    = "/boot/vmlinuz"
	jailInitramfs = "/boot/initramfs.cpio.gz"
	jailBaseDisk  = "/disks/base.ext4"
	jailRWDisk    = "/disks/rw.ext4"
	jailConfig    = "/disks/config.img"
	jailAPISock   = "/run/firecracker.socket"
	jailVsock     = "/run/vsock.sock"
	jailLog       = "/logs/firecracker.log"
	jailMetrics   = "/logs/metrics.json"
	jailConsole   = "/logs/console.log"
	// LogFile and ConsoleFile are Firecracker's log and the serial console, relative to the
	// jail's root.
	LogFile     = "logs/firecracker.log"
	ConsoleFile = "logs/console.log"
	MetricsFile = "logs/metrics.json"
	// JailerLog is the jailer's output, in the VM's directory.
	JailerLog = "jailer.log"
	// A suspended VM's snapshot, in the jail.
	jailSnapshotState = "/snapshot/vm.state"
	jailSnapshotMem   = "/snapshot/vm.mem"
	// GuestCID is the guest's vsock context id (every VM has its own vsock device).
	GuestCID = 3
	// ChannelPort is the vsock port imp-init connects to; Firecracker forwards the guest's
	// connections to the host socket <uds_path>_<port> in the jail.
	ChannelPort = 1024
)

// SnapshotFiles are a suspended VM's snapshot files, relative to its jail's root.
var SnapshotFiles = []string{strings.TrimPrefix(jailSnapshotState, "/"), strings.TrimPrefix(jailSnapshotMem, "/")}

// RemoveSnapshot removes a suspended VM's snapshot from the jail at chroot, without following a
// link out of it: a run that ended cannot be resumed.
func RemoveSnapshot(chroot string) error {
	for _, f := range []string{jailSnapshotState, jailSnapshotMem} {
		if err := removeInJail(chroot, f); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("removing the snapshot from the jail: %w", err)
		}
	}
	return nil
}

// Spec is one VM as Firecracker runs it.
type Spec struct {
	// ID names the jail (jailer --id): the VM's UID.
	ID string
	// Dir is the VM's state directory on the host (record, jailer output).
	Dir string
	// Firecracker and Jailer are the binaries.
	Firecracker, Jailer string
	// UID and GID the VMM runs as, one pair per VM from the node's range.
	UID, GID int
	// ChrootBase is where jails are built (jailer --chroot-base-dir).
	ChrootBase string
	// NetNS, when set, is the network namespace (a path) the VMM joins.
	NetNS string
	// CgroupVersion is the host's cgroup version (1 or 2) for the VM's limits.
	CgroupVersion int
	// Weight, when set, is the VMM's CPU weight (cgroup.WeightFile): a warm pool member's,
	// restored to wait idle, is cgroup.BackgroundWeight until its handover.
	Weight int
	// Host paths of what the VM boots.
	Kernel, Initramfs, BaseDisk, WritableDisk string
	// ConfigDisk is the run's configuration disk (guestinit.EncodeConfigDisk); the jail gets
	// it anew for every run.
	ConfigDisk string
	VCPUs      int
	MemoryMiB  int64
	// Token authenticates the guest channel.
	Token string
	// Tap is the VM's tap (host_dev_name) and Net the guest's network, when it has one.
	Tap string
	Net *guestinit.Net
	// DiskRate limits the writable disk, when set.
	DiskRate *RateLimiter
	// Drives are the VM's disk volumes, each linked into the jail's /disks as the writable
	// disk is (owned by the VM's uid) and attached as a drive; the guest finds each by its
	// serial, which Firecracker derives from the file (DriveSerial).
	Drives []vmm.Drive
}

// ChrootDir is the jail's root: <chroot base>/<firecracker binary name>/<id>/root.
func (s Spec) ChrootDir() string {
	return filepath.Join(JailDir(s.ChrootBase, s.Firecracker, s.ID), "root")
}

// ConsoleLog is the host path of the VM's serial console output.
func (s Spec) ConsoleLog() string { return filepath.Join(s.ChrootDir(), jailConsole) }

// APISocket is the API socket's host path.
func (s Spec) APISocket() string { return filepath.Join(s.ChrootDir(), jailAPISock) }

// MemoryLimit is the VMM's cgroup memory limit: the guest's memory and 64 MiB for the VMM.
func (s Spec) MemoryLimit() int64 { return (s.MemoryMiB + 64) << 20 }

// JailerArgs is the jailer's command line for s.
func (s Spec) JailerArgs() []string {
	args := []string{
		"--id", s.ID,
		"--exec-file", s.Firecracker,
		"--uid", strconv.Itoa(s.UID), "--gid", strconv.Itoa(s.GID),
		"--chroot-base-dir", s.ChrootBase,
	}
	period := 100000
	quota := s.VCPUs * period
	if s.CgroupVersion == 1 {
		args = append(args, "--cgroup-version", "1",
			"--cgroup", fmt.Sprintf("cpu.cfs_period_us=%d", period),
			"--cgroup", fmt.Sprintf("cpu.cfs_quota_us=%d", quota),
			"--cgroup", fmt.Sprintf("memory.limit_in_bytes=%d", s.MemoryLimit()))
	} else {
		args = append(args, "--cgroup-version", "2",
			"--cgroup", fmt.Sprintf("cpu.max=%d %d", quota, period),
			"--cgroup", fmt.Sprintf("memory.max=%d", s.MemoryLimit()))
	}
	if s.Weight > 0 {
		file, v := cgroup.WeightFile(s.CgroupVersion, s.Weight)
		args = append(args, "--cgroup", file+"="+v)
	}
	args = append(args, "--parent-cgroup", cgroup.Parent)
	if s.NetNS != "" {
		args = append(args, "--netns", s.NetNS)
	}
	// Not --daemonize: it would put /dev/null where the serial console's input comes from,
	// Firecracker's stdin. Start gives it its own session instead.
	return append(args, "--", "--api-sock", jailAPISock)
}

// BootArgs is the guest kernel's command line.
func (s Spec) BootArgs() string {
	p := []string{"console=ttyS0", "reboot=k", "panic=1", "pci=off", "quiet",
		"i8042.noaux", "i8042.nomux", "i8042.nopnp", "i8042.dumbkbd", // Ctrl-Alt-Del without probing delays
		guestinit.TokenParam + "=" + s.Token, guestinit.ChannelParam + "=vsock:" + strconv.Itoa(ChannelPort)}
	if s.Net != nil {
		p = append(p, s.Net.Params()...)
	}
	return strings.Join(p, " ")
}

// PrepareChroot builds the jail: the kernel and initramfs under /boot, the disks under
// /disks, an empty /run for the sockets and /logs for the VMM's log and metrics — hard links
// where the file system allows, copies otherwise. The root, /run, /logs and the writable disk
// belong to the VM's uid; the shared kernel, initramfs and base disk stay root's and
// read-only. Nothing else of the host is in the jail.
//
// The jail belongs to the VM's uid, so a compromised VMM may have replaced anything in it with a
// symbolic or hard link to a host file or to the shared base disk. Everything here goes through
// os.Root, never follows a link at the last component, and replaces any file that is not the
// one the jail should hold: the agent never chowns, truncates or writes through what the VMM
// planted.
func PrepareChroot(s Spec) error {
	if err := os.MkdirAll(s.ChrootDir(), 0o750); err != nil {
		return fmt.Errorf("creating the jail: %w", err)
	}
	root, err := os.OpenRoot(s.ChrootDir())
	if err != nil {
		return fmt.Errorf("opening the jail: %w", err)
	}
	defer root.Close()
	if err := resetJail(root, filepath.Base(s.Firecracker)); err != nil {
		return err
	}
	dirs := []string{"boot", "disks", "run", "logs", "snapshot"}
	for _, d := range dirs {
		if err := root.Mkdir(d, 0o750); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("creating /%s in the jail: %w", d, err)
		}
		if fi, err := root.Lstat(d); err != nil || !fi.IsDir() {
			return fmt.Errorf("the jail's /%s is not a directory (%v): refusing the jail", d, err)
		}
	}
	// The run's configuration replaces the previous run's.
	if err := RemoveConfig(s.ChrootDir()); err != nil {
		return err
	}
	// The VM's own files (chowned to its uid) and the node's it only reads.
	type jailFile struct {
		src, dst string
		owned    bool
		readOnly bool // the VM's to read only: root's, readable by its group (it may not chmod it)
	}
	files := []jailFile{
		{s.Kernel, jailKernel, false, false}, {s.Initramfs, jailInitramfs, false, false},
		{s.BaseDisk, jailBaseDisk, false, false}, {s.WritableDisk, jailRWDisk, true, false}, {s.ConfigDisk, jailConfig, true, false},
	}
	for _, d := range s.Drives {
		files = append(files, jailFile{d.Path, jailDrive(d), !d.ReadOnly, d.ReadOnly})
	}
	for _, f := range files {
		name := strings.TrimPrefix(f.dst, "/")
		if err := placeIn(root, name, f.src); err != nil {
			return fmt.Errorf("putting %s in the jail: %w", f.src, err)
		}
		if f.owned {
			if err := root.Lchown(name, s.UID, s.GID); err != nil {
				return err
			}
		}
		if f.readOnly {
			if err := root.Lchown(name, 0, s.GID); err != nil {
				return err
			}
			if err := root.Chmod(name, 0o440); err != nil {
				return err
			}
		}
	}
	for _, f := range []string{jailLog, jailMetrics, jailConsole} {
		name := strings.TrimPrefix(f, "/")
		fi, err := root.Lstat(name)
		if err == nil && fi.Mode().IsRegular() && fi.Sys().(*syscall.Stat_t).Nlink == 1 {
			continue // kept across restarts of the VM: the console log above all
		}
		if err == nil {
			if err := root.Remove(name); err != nil {
				return fmt.Errorf("removing what replaced the jail's %s: %w", f, err)
			}
		}
		out, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o640)
		if err != nil {
			return err
		}
		out.Close()
		if err := root.Lchown(name, s.UID, s.GID); err != nil {
			return err
		}
	}
	for _, d := range append([]string{"."}, dirs...) {
		if err := root.Lchown(d, s.UID, s.GID); err != nil {
			return err
		}
	}
	return nil
}

// resetJail removes from a kept jail what the jailer and the VMM make at each start, which
// they fail on when it exists: the jailer mknods /dev/net/tun, /dev/kvm, /dev/urandom and
// /dev/userfaultfd ("File exists" ends it before the API socket appears) and copies the VMM's
// binary in; Firecracker binds its API and vsock sockets in /run. What the agent keeps between
// runs stays: the disks, the logs and console, a suspended VM's snapshot. Through root: no link
// the VMM planted is followed.
func resetJail(root *os.Root, execName string) error {
	for _, name := range []string{"dev", "run", execName, execName + ".pid"} {
		if err := root.RemoveAll(name); err != nil {
			return fmt.Errorf("removing the last start's /%s from the jail: %w", name, err)
		}
	}
	return nil
}

// jailDrive is where, in the jail, the drive d is.
func jailDrive(d vmm.Drive) string { return "/disks/vol-" + d.ID + ".img" }

// DriveSerial is the serial the guest reads of a drive whose file, in the jail, is the file at
// path (a hard link of it): Firecracker's block device answers VIRTIO_BLK_T_GET_ID with the
// file's st_dev, st_rdev and st_ino in decimal, run together and cut to 20 bytes (as kvmtool
// does; Firecracker's source, block/virtio/device.rs build_device_id). Not configurable: the
// agent computes it, and a copy placed in the jail instead of a link has another.
func DriveSerial(path string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return "", err
	}
	id := fmt.Sprintf("%d%d%d", st.Dev, st.Rdev, st.Ino)
	if len(id) > 20 {
		id = id[:20]
	}
	return id, nil
}

// placeIn makes name inside root the file src: left alone when it is src already (a hard
// link), or a copy of it made earlier (root's, of src's size and modification time: the copy
// takes src's, and a base disk built anew, or a restore's snapshot base, is a new file with its
// own); otherwise whatever is there goes and src is linked (or, across file systems, copied) in
// its place.
func placeIn(root *os.Root, name, src string) error {
	want, err := os.Stat(src)
	if err != nil {
		return err
	}
	if fi, err := root.Lstat(name); err == nil {
		if os.SameFile(fi, want) {
			return nil
		}
		if fi.Mode().IsRegular() && fi.Sys().(*syscall.Stat_t).Nlink == 1 && fi.Size() == want.Size() && fi.ModTime().Equal(want.ModTime()) && fi.Sys().(*syscall.Stat_t).Uid == 0 {
			return nil // a copy made where links cannot be, and still root's
		}
		if err := root.Remove(name); err != nil {
			return fmt.Errorf("removing what replaced %s: %w", name, err)
		}
	}
	dir, base := path.Split(name)
	d, err := root.Open(path.Clean("./" + dir))
	if err != nil {
		return err
	}
	defer d.Close()
	if err := unix.Linkat(unix.AT_FDCWD, src, int(d.Fd()), base, 0); err == nil {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, want.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	return root.Chtimes(name, want.ModTime(), want.ModTime())
}

// RemoveConfig removes the run's configuration disk from the jail at chroot. The jail's
// directories belong to the VM's uid, so a compromised VMM may have made them symlinks: the
// removal stays inside the jail (os.Root) and refuses to follow one out of it.
func RemoveConfig(chroot string) error {
	root, err := os.OpenRoot(chroot)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening the jail: %w", err)
	}
	defer root.Close()
	if err := root.Remove(strings.TrimPrefix(jailConfig, "/")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the run's configuration from the jail: %w", err)
	}
	return nil
}

// Start builds the jail, launches the jailer detached from the caller (own session; the
// jailer execs Firecracker in the same process), configures the VM over the API and starts
// it. It writes and returns the VM's record. The serial console's input is Firecracker's
// stdin, the FIFO ConsoleInput in the VM's directory.
func Start(ctx context.Context, s Spec, configHash string) (*vmm.Record, error) {
	return launch(ctx, s, configHash, func(c *Client) error { return configure(ctx, c, s) },
		func(c *Client) error { return instanceStart(ctx, c) })
}

// Suspend pauses the VM, writes its snapshot (state and memory) into the jail and kills the
// VMM, whose memory goes back to the node. When the snapshot fails the VM is resumed.
func Suspend(ctx context.Context, s Spec, rec *vmm.Record) error {
	c := NewJailClient(s.ChrootDir())
	if err := Pause(ctx, c); err != nil {
		return err
	}
	if err := CreateSnapshot(ctx, c, jailSnapshotState, jailSnapshotMem); err != nil {
		if rerr := Resume(ctx, c); rerr != nil {
			return fmt.Errorf("%w; and resuming the VM failed: %v", err, rerr)
		}
		return err
	}
	_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
	for i := 0; i < 100 && rec.Alive(); i++ {
		time.Sleep(20 * time.Millisecond)
	}
	if rec.Alive() {
		return errors.New("the VMM did not exit after its snapshot")
	}
	return nil
}

// Snapshotted says whether the VM jailed for s has a snapshot to resume from.
func Snapshotted(s Spec) bool {
	return existsInJail(s.ChrootDir(), jailSnapshotState)
}

// ResumeSnapshot starts a fresh VMM in the VM's jail and loads its snapshot, resuming the VM
// where it stopped; the snapshot files are removed once loaded.
func ResumeSnapshot(ctx context.Context, s Spec, configHash string) (*vmm.Record, error) {
	rec, err := launch(ctx, s, configHash, func(c *Client) error { return LoadSnapshot(ctx, c, jailSnapshotState, jailSnapshotMem, false) },
		func(c *Client) error { return Resume(ctx, c) })
	if err == nil {
		for _, f := range []string{jailSnapshotState, jailSnapshotMem} {
			_ = removeInJail(s.ChrootDir(), f)
		}
	}
	return rec, err
}

// launch starts the jailer for s and has configure make the VM (its drives opened by the VMM),
// then, the claims' nodes gone from the jail (dropDeviceDrives), run start it: the guest never
// runs while a node of a claim's device is in its jail, whatever the agent lives to do next.
func launch(ctx context.Context, s Spec, configHash string, configure, run func(*Client) error) (*vmm.Record, error) {
	if err := PrepareChroot(s); err != nil {
		return nil, err
	}
	if err := removeInJail(s.ChrootDir(), jailAPISock); err != nil {
		return nil, fmt.Errorf("removing the old API socket: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, JailerLog), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	in, err := consoleFIFO(s.Dir)
	if err != nil {
		return nil, err
	}
	defer in.Close()
	cmd := exec.Command(s.Jailer, s.JailerArgs()...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = in, logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting the jailer: %w", err)
	}
	go func() { _ = cmd.Wait() }()
	failpoint.Crash("vmm-started")
	st, err := vmm.StartTime(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		return nil, err
	}
	rec := &vmm.Record{Kind: "firecracker", Pid: cmd.Process.Pid, StartTime: st, ConfigHash: configHash}
	fail := func(err error) (*vmm.Record, error) {
		_ = cmd.Process.Kill()
		return nil, err
	}
	if err := waitForSocket(ctx, s.ChrootDir(), rec, 10*time.Second); err != nil {
		return fail(err)
	}
	c := NewJailClient(s.ChrootDir())
	if err := configure(c); err != nil {
		return fail(err)
	}
	if err := dropDeviceDrives(s); err != nil {
		return fail(err)
	}
	if err := run(c); err != nil {
		return fail(err)
	}
	if err := vmm.WriteRecord(s.Dir, rec); err != nil {
		return fail(err)
	}
	return rec, nil
}

// dropDeviceDrives removes from the jail the nodes of the drives that are devices (claims':
// their devices, or the loop devices their disk images are bound to) once Firecracker has them
// open, as it does when their drives are configured or its snapshot loaded, and before its
// guest runs. A VMM that closed
// one could otherwise open it again once the node gave the device's number to another VM's or
// pod's volume, which a freed loop device soon is.
func dropDeviceDrives(s Spec) error {
	for _, d := range s.Drives {
		fi, err := os.Lstat(d.Path)
		if err != nil {
			return err
		}
		if fi.Mode()&os.ModeDevice == 0 {
			continue
		}
		if err := removeInJail(s.ChrootDir(), jailDrive(d)); err != nil {
			return fmt.Errorf("removing the node of drive %s from the jail: %w", d.ID, err)
		}
	}
	return nil
}

// ConsoleInput is the FIFO in a VM's directory that is its Firecracker's stdin, the serial
// console's input.
const ConsoleInput = "console.in"

// consoleFIFO makes the VM's console FIFO anew and opens it for the VMM: read and write, so
// that it never reads an end when a writer goes and the agent can open it without waiting.
func consoleFIFO(dir string) (*os.File, error) {
	p := filepath.Join(dir, ConsoleInput)
	if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("removing the old console input: %w", err)
	}
	if err := syscall.Mkfifo(p, 0o600); err != nil {
		return nil, fmt.Errorf("making the console input: %w", err)
	}
	f, err := os.OpenFile(p, os.O_RDWR|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the console input: %w", err)
	}
	return f, nil
}

// OpenConsole opens the serial console's input of the VM in dir for writing, without
// blocking: it fails when no VMM reads it.
func OpenConsole(dir string) (*os.File, error) {
	return os.OpenFile(filepath.Join(dir, ConsoleInput), os.O_WRONLY|syscall.O_NONBLOCK|syscall.O_NOFOLLOW, 0)
}

// waitForSocket waits until the VMM accepts connections on its API socket.
func waitForSocket(ctx context.Context, root string, rec *vmm.Record, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		// Accepting, not only there: the VMM binds the socket before it listens on it, and a
		// connection between the two is refused.
		if existsInJail(root, jailAPISock) {
			if c, err := dialInJail(root, jailAPISock); err == nil {
				c.Close()
				return nil
			}
		}
		if !rec.Alive() {
			return errors.New("the jailer exited before Firecracker's API socket appeared (see jailer.log)")
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("no API socket at %s after %v", filepath.Join(root, jailAPISock), timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Configure configures a fresh Firecracker for s and starts the VM: logger and metrics,
// machine, boot source, drives, network interface, vsock, InstanceStart.
func Configure(ctx context.Context, c *Client, s Spec) error {
	if err := configure(ctx, c, s); err != nil {
		return err
	}
	return instanceStart(ctx, c)
}

// instanceStart boots the configured VM.
func instanceStart(ctx context.Context, c *Client) error {
	return c.Do(ctx, "PUT", "/actions", Action{ActionType: "InstanceStart"}, nil)
}

// configure configures a fresh Firecracker for s, without starting it.
func configure(ctx context.Context, c *Client, s Spec) error {
	steps := []struct {
		method, path string
		body         any
	}{
		{"PUT", "/logger", Logger{LogPath: jailLog, Level: "Info"}},
		{"PUT", "/metrics", Metrics{MetricsPath: jailMetrics}},
		{"PUT", "/serial", Serial{SerialOutPath: jailConsole}},
		{"PUT", "/machine-config", MachineConfig{VCPUCount: s.VCPUs, MemSizeMiB: s.MemoryMiB}},
		{"PUT", "/boot-source", BootSource{KernelImagePath: jailKernel, InitrdPath: jailInitramfs, BootArgs: s.BootArgs()}},
		{"PUT", "/drives/base", Drive{DriveID: "base", PathOnHost: jailBaseDisk, IsReadOnly: true}},
		{"PUT", "/drives/rw", Drive{DriveID: "rw", PathOnHost: jailRWDisk, RateLimiter: s.DiskRate}},
		{"PUT", "/drives/config", Drive{DriveID: "config", PathOnHost: jailConfig, IsReadOnly: true}},
	}
	for _, d := range s.Drives {
		steps = append(steps, struct {
			method, path string
			body         any
		}{"PUT", "/drives/vol-" + d.ID, Drive{DriveID: "vol-" + d.ID, PathOnHost: jailDrive(d), IsReadOnly: d.ReadOnly}})
	}
	if s.Tap != "" && s.Net != nil {
		steps = append(steps, struct {
			method, path string
			body         any
		}{"PUT", "/network-interfaces/eth0", NetworkInterface{IfaceID: "eth0", HostDevName: s.Tap, GuestMAC: s.Net.MAC, MTU: s.Net.MTU}})
	}
	steps = append(steps,
		struct {
			method, path string
			body         any
		}{"PUT", "/vsock", Vsock{GuestCID: GuestCID, UDSPath: jailVsock}},
	)
	for _, st := range steps {
		if err := c.Do(ctx, st.method, st.path, st.body, nil); err != nil {
			return err
		}
	}
	return nil
}

// Stop asks the guest to stop (Ctrl-Alt-Del: imp-init sends the workload SIGTERM), waits
// grace, then kills the VMM.
func Stop(ctx context.Context, c *Client, rec *vmm.Record, grace time.Duration) error {
	if err := c.Do(ctx, "PUT", "/actions", Action{ActionType: "SendCtrlAltDel"}, nil); err != nil && !exits(rec, min(grace, time.Second)) {
		// Not a VMM that hung up as it went (the guest stopped at once): one that cannot
		// be asked.
		err = fmt.Errorf("asking the guest to stop: %w", err)
		_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		return err
	}
	for deadline := time.Now().Add(grace); rec.Alive() && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
	}
	if rec.Alive() {
		_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
		for i := 0; i < 50 && rec.Alive(); i++ {
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// exits reports whether rec's VMM is gone within d.
func exits(rec *vmm.Record, d time.Duration) bool {
	for deadline := time.Now().Add(d); rec.Alive() && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	return !rec.Alive()
}

// Pause pauses the VM's vCPUs.
func Pause(ctx context.Context, c *Client) error {
	return c.Do(ctx, "PATCH", "/vm", VMState{State: "Paused"}, nil)
}

// Resume resumes a paused VM.
func Resume(ctx context.Context, c *Client) error {
	return c.Do(ctx, "PATCH", "/vm", VMState{State: "Resumed"}, nil)
}

// CreateSnapshot writes a paused VM's state and memory to files (jail paths).
func CreateSnapshot(ctx context.Context, c *Client, statePath, memPath string) error {
	return c.Do(ctx, "PUT", "/snapshot/create", SnapshotCreate{SnapshotType: "Full", SnapshotPath: statePath, MemFilePath: memPath}, nil)
}

// LoadSnapshot restores a VM into a fresh Firecracker from its state and memory files (jail
// paths), resuming it when resume is set.
func LoadSnapshot(ctx context.Context, c *Client, statePath, memPath string, resume bool) error {
	return c.Do(ctx, "PUT", "/snapshot/load", SnapshotLoad{SnapshotPath: statePath,
		MemBackend: &MemoryBackend{BackendType: "File", BackendPath: memPath}, ResumeVM: resume}, nil)
}

// Info returns the instance's state ("Not started", "Running", "Paused").
func Info(ctx context.Context, c *Client) (*InstanceInfo, error) {
	var info InstanceInfo
	return &info, c.Do(ctx, "GET", "/", nil, &info)
}

// DialChannel connects to the guest channel of the VM jailed at root: a host-initiated vsock
// connection through Firecracker's vsock socket ("CONNECT <port>", answered "OK <port>").
func DialChannel(root string) (net.Conn, error) { return dialPort(root, ChannelPort) }

// DialSession connects to the session channel of the VM jailed at root, the vsock port above
// the guest channel's.
func DialSession(root string) (net.Conn, error) {
	return dialPort(root, ChannelPort+guestsession.VsockPortOffset)
}

func dialPort(root string, port int) (net.Conn, error) {
	conn, err := dialInJail(root, jailVsock)
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintf(conn, "CONNECT %d\n", port); err != nil {
		conn.Close()
		return nil, err
	}
	// The acknowledgement, byte by byte: what follows it is the guest's.
	var line []byte
	b := make([]byte, 1)
	for len(line) < 64 {
		if _, err := conn.Read(b); err != nil {
			conn.Close()
			return nil, fmt.Errorf("vsock CONNECT %d: %w", port, err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
	}
	if !strings.HasPrefix(string(line), "OK ") {
		conn.Close()
		return nil, fmt.Errorf("vsock CONNECT %d: %q", port, line)
	}
	_ = conn.SetDeadline(time.Time{})
	return conn, nil
}

// JailDir is the directory the jailer makes for the VM id under base (its root's parent),
// which the agent removes with the VM.
func JailDir(base, firecrackerBin, id string) string {
	return filepath.Join(base, filepath.Base(firecrackerBin), id)
}
