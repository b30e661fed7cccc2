package guestinit

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Run is imp-init's main: it never returns; it powers the VM off.
func Run() {
	code, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "imp-init:", err)
		if code < 0 {
			code = 127
		}
	}
	ch.flush(5 * time.Second)
	unix.Sync()
	if rwDir >= 0 {
		// Freezing the writable disk's ext4 checkpoints its journal: the disk is consistent
		// as it lies, for a host that reads it and for the next boot alike.
		if err := unix.IoctlSetInt(rwDir, fiFreeze, 0); err != nil {
			fmt.Fprintln(os.Stderr, "imp-init: freezing the writable disk:", err)
		}
	}
	for _, fd := range volumeDirs {
		if err := unix.IoctlSetInt(fd, fiFreeze, 0); err != nil {
			fmt.Fprintln(os.Stderr, "imp-init: freezing a disk volume:", err)
		}
	}
	fmt.Fprintf(os.Stderr, "imp-init: workload exited with code %d; powering off\n", code)
	if ch != nil && ch.vsock {
		// Firecracker has no power-off: it exits on the reset of a reboot (reboot=k).
		_ = unix.Reboot(unix.LINUX_REBOOT_CMD_RESTART)
	}
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
	select {} // the kernel takes it from here
}

var ch *channel

// boot is how this boot went, for the ready message.
var boot Boot

// bootClock is the kernel's boot clock, in microseconds.
func bootClock() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	return uint64(ts.Nano() / 1000)
}

// phase ends the phase of the boot under way, if any, and begins name (none for "").
func phase(name string) {
	now := bootClock()
	if n := len(boot.Phases); n > 0 && boot.Phases[n-1].End == 0 {
		boot.Phases[n-1].End = now
	}
	if name != "" {
		boot.Phases = append(boot.Phases, Phase{Name: name, Start: now})
	}
}

// rwDir is a descriptor of the writable disk's root, kept across the switch into the overlay
// root (which hides its mount point), to freeze the file system before powering off.
var rwDir = -1

// fiFreeze is FIFREEZE, _IOWR('X', 119, int), which x/sys/unix does not define.
const fiFreeze = 0xC0045877

func run() (int, error) {
	boot.Init = bootClock()
	phase("mounts")
	for _, m := range []struct{ src, dst, fstype string }{
		{"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"}, {"devtmpfs", "/dev", "devtmpfs"},
	} {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return -1, err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
			return -1, fmt.Errorf("mounting %s: %w", m.dst, err)
		}
	}
	if err := makeWorkloadCgroup(); err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: the workload runs without a cgroup of its own (a snapshot cannot freeze it):", err)
	}
	// Terminals for exec -t: devpts, and /dev/ptmx where programs look for it.
	if err := os.MkdirAll("/dev/pts", 0o755); err == nil {
		if err := unix.Mount("devpts", "/dev/pts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"); err != nil && !errors.Is(err, unix.EBUSY) {
			fmt.Fprintln(os.Stderr, "imp-init: mounting /dev/pts:", err)
		}
		if _, err := os.Lstat("/dev/ptmx"); err != nil {
			_ = os.Symlink("pts/ptmx", "/dev/ptmx")
		}
	}
	// Ctrl-Alt-Del sends PID 1 SIGINT instead of rebooting at once.
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_CAD_OFF)
	cmdline, _ := os.ReadFile("/proc/cmdline")
	params := strings.Fields(string(cmdline))
	phase("modules")
	if err := loadModules(params); err != nil {
		return -1, err
	}

	var err error
	phase("channel")
	ch, err = openChannel(param(params, TokenParam), param(params, ChannelParam))
	if err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: no guest channel:", err)
	}

	phase("disks")
	base, rw, cfg, err := findDisks(10 * time.Second)
	if err != nil {
		return ch.fail(err)
	}
	if cfg.OS {
		if err := loadOSModules(); err != nil {
			return ch.fail(err)
		}
	}
	for _, d := range []string{"/run/lower", "/run/rw", "/run/root"} {
		_ = os.MkdirAll(d, 0o755)
	}
	if err := unix.Mount(base, "/run/lower", "ext4", unix.MS_RDONLY, ""); err != nil {
		return ch.fail(fmt.Errorf("mounting the base disk %s: %w", base, err))
	}
	if err := unix.Mount(rw, "/run/rw", "ext4", 0, ""); err != nil {
		return ch.fail(fmt.Errorf("mounting the writable disk %s: %w", rw, err))
	}
	if fd, err := unix.Open("/run/rw", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
		rwDir = fd
	}
	for _, d := range []string{"/run/rw/upper", "/run/rw/work"} {
		_ = os.MkdirAll(d, 0o755)
	}
	if err := unix.Mount("overlay", "/run/root", "overlay", 0, "lowerdir=/run/lower,upperdir=/run/rw/upper,workdir=/run/rw/work"); err != nil {
		return ch.fail(fmt.Errorf("mounting the overlay root: %w", err))
	}
	// Agents before the configuration disk left the configuration, secrets and all, on the
	// writable disk: it has no use any more.
	_ = os.RemoveAll(filepath.Join("/run/rw", filepath.Dir(legacyConfigPath)))
	loopbackUp()
	phase("network")
	gnet, err := ParseNet(params)
	if err != nil {
		return ch.fail(err)
	}
	if gnet != nil {
		if err := configureNet(gnet, 10*time.Second); err != nil {
			return ch.fail(fmt.Errorf("configuring the network: %w", err))
		}
	}
	phase("volumes")
	if err := switchRoot("/run/root"); err != nil {
		return ch.fail(err)
	}
	if cfg.Hostname != "" {
		_ = unix.Sethostname([]byte(cfg.Hostname))
	}
	if gnet != nil {
		if err := writeNetFiles(gnet, cfg.Hostname); err != nil {
			return ch.fail(err)
		}
	}
	if err := mountVolumes(cfg, 10*time.Second); err != nil {
		return ch.fail(fmt.Errorf("volumes: %w", err))
	}
	if cfg.OS {
		return handOver(cfg, gnet, param(params, ChannelParam))
	}
	return runWorkload(cfg, gnet)
}

func param(params []string, key string) string {
	for _, p := range params {
		if v, ok := strings.CutPrefix(p, key+"="); ok {
			return v
		}
	}
	return ""
}

// loadModules loads the initramfs's modules in order. virtio_mmio gets the device= parameters
// QEMU's microvm and Firecracker put on the kernel command line (only the kernel's own
// modprobe would read them there).
func loadModules(params []string) error {
	return loadModuleList("/lib/modules/imp/order", params)
}

// loadOSModules loads the modules an OS's init needs and a workload does not (autofs4 for
// systemd's automounts, binfmt_misc), from the initramfs, before the switch into the root
// (the image holds no modules of this kernel).
func loadOSModules() error {
	return loadModuleList("/lib/modules/imp/os-order", nil)
}

func loadModuleList(orderFile string, params []string) error {
	order, err := os.ReadFile(orderFile)
	if err != nil {
		return nil // no modules: everything is built in
	}
	var mmio []string
	for _, p := range params {
		if v, ok := strings.CutPrefix(p, "virtio_mmio.device="); ok {
			mmio = append(mmio, "device="+v)
		}
	}
	for _, name := range strings.Fields(string(order)) {
		f, err := os.Open("/lib/modules/imp/" + name)
		if err != nil {
			return err
		}
		args := ""
		if name == "virtio_mmio.ko" {
			args = strings.Join(mmio, " ")
		}
		err = unix.FinitModule(int(f.Fd()), args, 0)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("loading module %s: %w", name, err)
		}
	}
	return nil
}

// legacyConfigPath is where, on the writable disk, agents before the configuration disk wrote
// the workload's Config.
const legacyConfigPath = "imp/config.json"

// findDisks returns the block devices labelled BaseLabel and WritableLabel, and the
// workload's Config from the configuration disk.
func findDisks(timeout time.Duration) (base, rw string, cfg Config, err error) {
	deadline := time.Now().Add(timeout)
	found := false
	for {
		devs, _ := filepath.Glob("/dev/vd*")
		for _, d := range devs {
			if isVolumeDevice(d) {
				continue // a volume's, whatever it holds
			}
			// The first of each: a VM's own disks come before its volumes (Firecracker
			// attaches them in that order; QEMU's volumes are skipped above by serial).
			switch l := ext4Label(d); {
			case l == BaseLabel && base == "":
				base = d
			case l == WritableLabel && rw == "":
				rw = d
			case l == BaseLabel || l == WritableLabel:
				// another disk with the label: a volume's, never the VM's own
			default:
				if !found {
					c, err := readConfigDisk(d)
					switch {
					case err == nil:
						cfg, found = c, true
					case !errors.Is(err, ErrNotConfigDisk):
						return "", "", cfg, fmt.Errorf("configuration disk %s: %w", d, err)
					}
				}
			}
		}
		if base != "" && rw != "" && found {
			return base, rw, cfg, nil
		}
		if time.Now().After(deadline) {
			return "", "", cfg, fmt.Errorf("disks labelled %s and %s and the configuration disk not all found among %v", BaseLabel, WritableLabel, devs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func readConfigDisk(dev string) (Config, error) {
	f, err := os.Open(dev)
	if err != nil {
		return Config{}, fmt.Errorf("%w: %v", ErrNotConfigDisk, err)
	}
	defer f.Close()
	return DecodeConfigDisk(f)
}

// ext4Label reads the volume name of an ext4 superblock (offset 1024, name at 0x78).
func ext4Label(dev string) string {
	f, err := os.Open(dev)
	if err != nil {
		return ""
	}
	defer f.Close()
	buf := make([]byte, 16)
	if _, err := f.ReadAt(buf, 1024+0x78); err != nil {
		return ""
	}
	return string(bytes.TrimRight(buf, "\x00"))
}

// switchRoot makes dir the root, carrying /proc, /sys and /dev along.
func switchRoot(dir string) error {
	for _, m := range []string{"/proc", "/sys", "/dev"} {
		target := dir + m
		_ = os.MkdirAll(target, 0o755)
		if err := unix.Mount(m, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("moving %s into the root: %w", m, err)
		}
	}
	if err := unix.Chdir(dir); err != nil {
		return err
	}
	if err := unix.Mount(dir, "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("moving the root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("entering the root: %w", err)
	}
	return unix.Chdir("/")
}

// command prepares argv to run as cfg's workload: its environment, user and working directory.
func command(cfg Config, argv []string) (*exec.Cmd, error) {
	env := cfg.Env
	if !hasEnv(env, "PATH") {
		env = append(env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	path, err := lookPath(argv[0], env)
	if err != nil {
		return nil, err
	}
	cred, err := credential(cfg.User)
	if err != nil {
		return nil, err
	}
	dir := cfg.WorkingDir
	if dir == "" {
		dir = "/"
	}
	// Else exec's error names the command ("fork/exec /app: no such file"), not the directory.
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("working directory: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("working directory %s: not a directory", dir)
	}
	attr := &syscall.SysProcAttr{Credential: cred, Setsid: true}
	if workload != nil {
		attr.UseCgroupFD, attr.CgroupFD = true, int(workload.Fd()) // born in it (clone3)
	}
	return &exec.Cmd{Path: path, Args: argv, Env: env, Dir: dir, SysProcAttr: attr}, nil
}

func runWorkload(cfg Config, gnet *Net) (int, error) {
	live.configure(cfg, gnet)
	prepareRestore()
	serveSessions()
	go reapAll()
	// Signals to PID 1 go to the workload (a held guest's end the VM).
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGUSR1, unix.SIGUSR2)
	go func() {
		for s := range sigs {
			if s == unix.SIGINT {
				// Ctrl-Alt-Del (Firecracker's SendCtrlAltDel; see run) asks the VM to stop:
				// the workload gets what a container's gets, SIGTERM.
				s = unix.SIGTERM
			}
			live.signal(s.(unix.Signal))
		}
	}()
	ready := Message{Event: "ready"}
	phase("workload")
	if cfg.Hold {
		// A template's VM snapshotted before its workload: the copy's restore starts it.
		ready.Message = HeldMessage
	} else if err := live.startWorkload(cfg); err != nil {
		return ch.fail(err)
	}
	phase("")
	boot.Ready = bootClock()
	ready.Boot = &boot
	ch.serve()
	ch.send(ready)
	if !cfg.Hold {
		live.runProbes(cfg)
	}
	code := <-live.ended
	_ = unix.Kill(-1, unix.SIGKILL) // whatever the workload left behind
	ch.send(Message{Event: "exit", Code: &code})
	return code, nil
}

// reapAll reaps every child of PID 1, for the rest of the VM's life: the workload's and each
// exec'd command's end go to their waiters (procs), an orphan's nowhere. A guest with no child
// (its workload held) waits for one to end.
func reapAll() {
	sigchld := make(chan os.Signal, 1)
	signal.Notify(sigchld, unix.SIGCHLD)
	for {
		var ws unix.WaitStatus
		got, err := unix.Wait4(-1, &ws, 0, nil)
		switch {
		case errors.Is(err, unix.EINTR):
		case err != nil: // ECHILD: none yet
			<-sigchld
		default:
			procs.reaped(got, ws)
		}
	}
}

// consoleTTY opens the serial console's terminal (the kernel's primary console) for the
// workload. As its controlling terminal (tty) it keeps the kernel's line discipline: lines
// edited and echoed, Ctrl-C a SIGINT. As its input alone, bytes pass as they come, unechoed,
// while output keeps the console's CR LF.
func consoleTTY(tty bool) (*os.File, error) {
	b, err := os.ReadFile("/sys/class/tty/console/active")
	names := strings.Fields(string(b))
	if err != nil || len(names) == 0 {
		return nil, fmt.Errorf("finding the console's terminal: %v", err)
	}
	name := names[len(names)-1] // the primary console, /dev/console
	f, err := os.OpenFile("/dev/"+name, os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("opening the console %s: %w", name, err)
	}
	if tty {
		return f, nil
	}
	t, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	if err == nil {
		t.Lflag &^= unix.ICANON | unix.ECHO | unix.ECHOE | unix.ECHOK | unix.ECHONL | unix.ECHOCTL | unix.ISIG | unix.IEXTEN
		t.Iflag &^= unix.ICRNL | unix.INLCR | unix.IGNCR | unix.IXON
		t.Cc[unix.VMIN], t.Cc[unix.VTIME] = 1, 0
		err = unix.IoctlSetTermios(int(f.Fd()), unix.TCSETS, t)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("setting the console %s's input raw: %w", name, err)
	}
	return f, nil
}

func hasEnv(env []string, name string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, name+"=") {
			return true
		}
	}
	return false
}

func lookPath(file string, env []string) (string, error) {
	if strings.Contains(file, "/") {
		return file, nil
	}
	for _, e := range env {
		if p, ok := strings.CutPrefix(e, "PATH="); ok {
			for _, d := range filepath.SplitList(p) {
				c := filepath.Join(d, file)
				if fi, err := os.Stat(c); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
					return c, nil
				}
			}
		}
	}
	return "", fmt.Errorf("%s: not found in the image's PATH", file)
}

// credential resolves "user[:group]" against the image's /etc/passwd and /etc/group.
func credential(spec string) (*syscall.Credential, error) {
	if spec == "" || spec == "root" || spec == "0" {
		return nil, nil
	}
	u, g, hasGroup := strings.Cut(spec, ":")
	uid, gid := -1, -1
	if n, err := strconv.Atoi(u); err == nil {
		uid = n
	}
	if uid < 0 || !hasGroup {
		if f := lookup("/etc/passwd", u, uid); f != nil {
			uid, _ = strconv.Atoi(f[2])
			gid, _ = strconv.Atoi(f[3])
		} else if uid < 0 {
			return nil, fmt.Errorf("user %q not in the image's /etc/passwd", u)
		}
	}
	if hasGroup {
		if n, err := strconv.Atoi(g); err == nil {
			gid = n
		} else if f := lookup("/etc/group", g, -1); f != nil {
			gid, _ = strconv.Atoi(f[2])
		} else {
			return nil, fmt.Errorf("group %q not in the image's /etc/group", g)
		}
	}
	if gid < 0 {
		gid = uid
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// lookup returns the fields of the line of file whose name is name or whose id is id.
func lookup(file, name string, id int) []string {
	f, err := os.Open(file)
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Split(sc.Text(), ":")
		if len(fields) < 4 {
			continue
		}
		if fields[0] == name || (id >= 0 && fields[2] == strconv.Itoa(id)) {
			return fields
		}
	}
	return nil
}

// channel is the guest end of the guest channel.
type channel struct {
	mu    sync.Mutex
	f     io.ReadWriter // the virtio-serial port, or the newest vsock connection (nil before one)
	token string
	// vsock: the host connects (and reconnects, after an agent restart); every message sent
	// is replayed to each new connection.
	vsock bool
	port  uint32 // vsock: the status channel's port
	// history is what a new host connection is told first: every message but the probes'
	// (a hello, a ready, an end: a few lines), then each probe's latest verdict.
	history [][]byte
	probes  map[string][]byte
	out     chan []byte   // virtio-serial: lines for the writer goroutine
	flushed chan struct{} // closed when the writer has written every line
}

// flush waits, up to timeout, for the lines sent so far to be written (before power-off).
func (c *channel) flush(timeout time.Duration) {
	if c == nil || c.out == nil {
		return
	}
	c.mu.Lock()
	close(c.out)
	c.out = nil
	c.mu.Unlock()
	select {
	case <-c.flushed:
	case <-time.After(timeout):
	}
}

// openChannel opens the virtio-serial port named ChannelName.
func openChannel(token, transport string) (*channel, error) {
	if port, ok := strings.CutPrefix(transport, "vsock:"); ok {
		return openVsockChannel(token, port)
	}
	dev, err := virtioPort(ChannelName)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	c := &channel{f: f, token: token, out: make(chan []byte, 64), flushed: make(chan struct{})}
	go func(out chan []byte) {
		defer close(c.flushed)
		for line := range out {
			_, _ = f.Write(line)
		}
	}(c.out)
	c.send(Message{Event: "hello", Token: token, Freezes: workload != nil})
	go c.watchHost(f)
	return c, nil
}

// replay is what a new host connection is told: the history, then each probe's latest
// verdict. The caller holds c.mu.
func (c *channel) replay() [][]byte {
	out := append([][]byte{}, c.history...)
	for _, k := range []string{"startup", "readiness", "liveness"} {
		if line, ok := c.probes[k]; ok {
			out = append(out, line)
		}
	}
	return out
}

// replayNow tells the host connection the replay, as a new one is told it (the agent asks
// too: a connection that follows another at once may come and go unseen by watchHost). It
// returns false once the channel is shutting down.
func (c *channel) replayNow() bool {
	c.mu.Lock() // held while queueing: flush closes the queue under it
	defer c.mu.Unlock()
	if !c.vsock && c.out == nil {
		return false
	}
	for _, line := range c.replay() {
		c.emit(line)
	}
	return true
}

// emit writes line to the host connection: vsock, the newest connection's; virtio-serial, the
// writer's queue, unless full (a host away for its 64 lines misses the newest, not the VM its
// boot) or closed (shutting down). The caller holds c.mu.
func (c *channel) emit(line []byte) {
	if c.vsock {
		if c.f != nil {
			_, _ = c.f.Write(line)
		}
		return
	}
	if c.out == nil {
		return
	}
	select {
	case c.out <- line:
	default:
	}
}

// answerRestore answers a restore with RestoredEvent and, when the queue takes the whole of
// it, the replay after it (the answer's Replay says so): else the agent asks for the replay,
// as it asks an older imp-init.
func (c *channel) answerRestore(token string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	lines := c.replay()
	whole := c.vsock || (c.out != nil && cap(c.out)-len(c.out) > len(lines)) // producers hold c.mu: the room only grows
	answer, _ := json.Marshal(Message{Event: RestoredEvent, Token: token, Replay: whole})
	c.emit(append(answer, '\n'))
	if whole {
		for _, line := range lines {
			c.emit(line)
		}
	}
}

// watchHost tells each new host connection of the virtio-serial port f (an agent that
// restarted, or resumed the VM) the replay, as the vsock channel does: the port polls HUP
// while no host is connected.
func (c *channel) watchHost(f *os.File) {
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	away := false
	for {
		var hup bool
		timeout := 1000 // connected: wait for a hang-up
		if away {
			timeout = 0 // away: is it still?
		}
		if err := rc.Control(func(fd uintptr) {
			pfd := []unix.PollFd{{Fd: int32(fd)}}
			if n, _ := unix.Poll(pfd, timeout); n > 0 {
				hup = pfd[0].Revents&unix.POLLHUP != 0
			}
		}); err != nil {
			return
		}
		if away && !hup && !c.replayNow() {
			return // shutting down
		}
		away = hup
		if hup {
			time.Sleep(hostPoll)
		}
	}
}

// hostPoll is how often the virtio-serial port is looked at while no host is connected: a new
// connection (an agent's restart, a resume, a restore) is told the history, and read, within it.
const hostPoll = 20 * time.Millisecond

// virtioPort is the device of the virtio-serial port named name, once the kernel shows it
// (within a second).
func virtioPort(name string) (string, error) {
	for i := 0; i < 50; i++ {
		names, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
		for _, n := range names {
			if b, _ := os.ReadFile(n); strings.TrimSpace(string(b)) == name {
				return "/dev/" + filepath.Base(filepath.Dir(n)), nil
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	return "", fmt.Errorf("no virtio-serial port named %s", name)
}

func (c *channel) send(m Message) {
	if c == nil {
		return
	}
	line, _ := json.Marshal(m)
	line = append(line, '\n')
	c.mu.Lock()
	defer c.mu.Unlock()
	switch m.Event {
	case "probe":
		if c.probes == nil {
			c.probes = map[string][]byte{}
		}
		c.probes[m.Probe] = line
	default:
		c.history = append(c.history, line)
	}
	// The virtio-serial port blocks writes until the host end connects (an agent restarting):
	// a writer goroutine waits for it, never init.
	c.emit(line)
}

// tell says m to the host connection as it stands, without keeping it for the next one (an
// answer to a request of this one).
func (c *channel) tell(m Message) {
	line, _ := json.Marshal(m)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.emit(append(line, '\n'))
}

// fail reports a start failure and returns the exit code the VM ends with.
func (c *channel) fail(err error) (int, error) {
	c.send(Message{Event: "error", Message: err.Error()})
	return 127, err
}

// serve answers the agent's requests, from the workload's start (or its hold) on.
func (c *channel) serve() {
	if c == nil {
		return
	}
	c.mu.Lock()
	f := c.f
	c.mu.Unlock()
	if !c.vsock {
		go c.read(f, true)
	} // vsock: each connection is read from its accept
}

// read answers the requests arriving on r. waitEOF: the port has no host end yet; retry.
func (c *channel) read(r io.Reader, waitEOF bool) {
	br := bufio.NewReader(r)
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			var req Request
			token := c.currentToken()
			if json.Unmarshal(line, &req) == nil && token != "" && req.Token == token {
				switch {
				case req.Op == "stop":
					live.signal(unix.SIGTERM)
				case req.Op == "replay":
					c.replayNow()
				case req.Op == "freeze":
					if freezeWorkload() {
						c.tell(Message{Event: FrozenEvent})
					}
				case req.Op == "thaw":
					thawWorkload()
				case req.Op == "restore" && req.Restore != nil:
					c.restore(req.Restore)
				}
			}
		}
		if err != nil {
			if waitEOF && errors.Is(err, io.EOF) {
				time.Sleep(hostPoll)
				continue
			}
			return
		}
	}
}

// openVsockChannel listens on vsock port for the host: Firecracker forwards a host connection
// to its vsock socket ("CONNECT <port>") here. Each connection, first or after an agent
// restart, gets every message sent so far, then the new ones.
func openVsockChannel(token, port string) (*channel, error) {
	p, err := strconv.ParseUint(port, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("%s=vsock:%q: %w", ChannelParam, port, err)
	}
	var fd int
	for i := 0; ; i++ { // the transport module may still be binding
		if fd, err = unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err == nil {
			if err = unix.Bind(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: uint32(p)}); err == nil {
				err = unix.Listen(fd, 4)
			}
			if err == nil {
				break
			}
			unix.Close(fd)
		}
		if i == 100 {
			return nil, fmt.Errorf("listening on vsock port %d: %w", p, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	c := &channel{token: token, vsock: true, port: uint32(p)}
	go func() {
		for {
			nfd, _, err := unix.Accept(fd)
			if err != nil {
				if errors.Is(err, unix.EINTR) {
					continue
				}
				return
			}
			conn := os.NewFile(uintptr(nfd), "vsock")
			c.mu.Lock()
			if old, ok := c.f.(io.Closer); ok {
				old.Close()
			}
			c.f = conn
			for _, line := range c.replay() {
				_, _ = conn.Write(line)
			}
			c.mu.Unlock()
			go c.read(conn, false)
		}
	}()
	c.send(Message{Event: "hello", Token: token, Freezes: workload != nil})
	return c, nil
}
