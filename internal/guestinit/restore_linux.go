package guestinit

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// live is the run as it stands: the configuration, network and probes of the boot, or of the
// VM this guest was restored as.
var live = &liveRun{ended: make(chan int, 1)}

type liveRun struct {
	mu     sync.Mutex
	cfg    Config
	net    *Net
	pid    int                // the workload; 0 while it is held
	probes context.CancelFunc // stops the probes of the configuration before
	ended  chan int           // the workload's exit code, or a held guest's end (128+signal)
}

func (l *liveRun) config() Config {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cfg
}

// configure records the run's configuration and network, as booted.
func (l *liveRun) configure(cfg Config, n *Net) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cfg, l.net = cfg, n
}

// held is true while the workload waits for a restore to start it (Config.Hold).
func (l *liveRun) held() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pid == 0
}

// startWorkload starts cfg's workload, with the serial console as its input or terminal when
// cfg says so; its end is sent on ended.
func (l *liveRun) startWorkload(cfg Config) error {
	cmd, err := command(cfg, cfg.Argv)
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if cfg.Stdin || cfg.TTY {
		tty, err := consoleTTY(cfg.TTY)
		if err != nil {
			return err
		}
		cmd.Stdin = tty
		if cfg.TTY {
			cmd.Stdout, cmd.Stderr = tty, tty
			cmd.SysProcAttr.Setctty, cmd.SysProcAttr.Ctty = true, 0
		}
	}
	wait, err := procs.start(cmd)
	if err != nil {
		return fmt.Errorf("starting %v: %w", cfg.Argv, err)
	}
	l.mu.Lock()
	l.pid = cmd.Process.Pid
	l.mu.Unlock()
	go func() { l.ended <- wait() }()
	return nil
}

// signal sends s to the workload; a held guest, which has none, ends (a stop of a template's
// VM or of a warm pool's member before any claim).
func (l *liveRun) signal(s unix.Signal) {
	l.mu.Lock()
	pid, osMode := l.pid, l.cfg.OS
	l.mu.Unlock()
	if pid > 0 {
		_ = unix.Kill(pid, s)
		return
	}
	if osMode && s == unix.SIGTERM {
		powerOff() // the agent's stop of an OS: its shutdown, within the grace period
		return
	}
	if s == unix.SIGTERM {
		select {
		case l.ended <- 128 + int(s):
		default:
		}
	}
}

// runProbes (re)starts the probes of cfg, stopping those of the configuration before, and the
// guest's Stats reports with them.
func (l *liveRun) runProbes(cfg Config) {
	ctx, cancel := context.WithCancel(context.Background())
	l.mu.Lock()
	if l.probes != nil {
		l.probes()
	}
	l.probes = cancel
	pid := l.pid
	l.mu.Unlock()
	go runProbes(ctx, cfg, pid)
	if ch != nil {
		go reportStats(ctx, ch)
	}
}

// restore makes this guest, restored from another VM's snapshot, the VM r describes: the
// clock, the kernel's random state, its own configuration disk, hostname and network, then
// it thaws the workload (frozen when the snapshot was taken), then the channel's token. The agent's rules drop whatever the guest sends from the snapshot's
// MAC until then. It answers on the channel with RestoredEvent, then tells the connection the
// replay, with the new token, when its queue takes all of it (answerRestore): the agent
// watches the run on this connection, and would otherwise ask for it, one more round trip
// through a guest whose code is still cold.
func (c *channel) restore(r *Restore) {
	// One at a time: each connection (an agent that reconnected mid-way) reads its own
	// requests, and two restores must not both find the workload held and both start it.
	restoring.Lock()
	defer restoring.Unlock()
	if err := applyRestore(r); err != nil {
		fmt.Fprintln(os.Stderr, "imp-init: taking on the restored VM's identity:", err)
		c.send(Message{Event: "error", Message: RestoreErrorPrefix + err.Error()})
		return
	}
	c.retoken(r.Token)
	c.answerRestore(r.Token)
}

// restoring serialises restores (channel.restore).
var restoring sync.Mutex

func applyRestore(r *Restore) error {
	if r.UnixNano > 0 {
		ts := unix.NsecToTimespec(r.UnixNano)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			return fmt.Errorf("stepping the clock: %w", err)
		}
	}
	if err := reseed(r.Entropy); err != nil {
		return err
	}
	cfg, err := restoredConfig(r)
	if err != nil {
		return err
	}
	n, err := ParseNet(r.Net)
	if err != nil {
		return err
	}
	live.mu.Lock()
	old, oldCfg := live.net, live.cfg
	live.mu.Unlock()
	if err := refreshVolumes(oldCfg, cfg); err != nil {
		return err
	}
	if n != nil && old != nil {
		if err := moveNet(old, n); err != nil {
			return fmt.Errorf("moving the network interface to %s %s: %w", n.MAC, n.Address, err)
		}
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return fmt.Errorf("setting the hostname: %w", err)
		}
	}
	if n != nil {
		if err := writeNetFiles(n, cfg.Hostname); err != nil {
			return err
		}
	}
	live.mu.Lock()
	live.cfg, live.net = cfg, n
	live.mu.Unlock()
	thawWorkload() // a snapshot froze it: it runs on as this VM, never as the snapshot's
	if live.held() {
		if cfg.Hold {
			return nil // a warm pool's member: its claim's restore starts the workload
		}
		// Snapshotted before its workload (a template's snapshotWhen.beforeWorkload): the
		// workload starts now, this VM's own, with its command, env and files.
		if err := live.startWorkload(cfg); err != nil {
			return fmt.Errorf("starting the workload: %w", err)
		}
	}
	live.runProbes(cfg)
	return nil
}

// urandom is /dev/urandom, opened at boot (prepareRestore) for a restore to reseed through.
var urandom *os.File

// prepareRestore opens /dev/urandom before the guest is ready, and so before any snapshot of
// it: opening it in a restored guest, whose every instruction is cold in its new VMM under
// TCG, took 40–130 ms of a restore (measured: the reseed from 41–132 ms to 2–42 ms).
func prepareRestore() {
	if f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0); err == nil {
		urandom = f
	}
}

// reseed mixes entropy into the kernel's pool, crediting it, and makes the kernel reseed its
// generator from the pool at once: the copies of a snapshot draw different numbers from here.
func reseed(entropy []byte) error {
	if len(entropy) < 32 {
		return fmt.Errorf("the host sent %d bytes of entropy, fewer than 32", len(entropy))
	}
	f := urandom
	if f == nil {
		var err error
		if f, err = os.OpenFile("/dev/urandom", os.O_WRONLY, 0); err != nil {
			return fmt.Errorf("opening /dev/urandom: %w", err)
		}
		defer f.Close()
	}
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	buf := make([]byte, 8+len(entropy))
	binary.NativeEndian.PutUint32(buf[0:], uint32(len(entropy)*8))
	binary.NativeEndian.PutUint32(buf[4:], uint32(len(entropy)))
	copy(buf[8:], entropy)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&buf[0]))); errno != 0 {
		return fmt.Errorf("adding the host's entropy: %w", errno)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); errno != 0 {
		return fmt.Errorf("reseeding the kernel's generator: %w", errno)
	}
	return nil
}

// restoredConfig is the restored VM's configuration: the one the request carries, or else
// (an agent that sends none) its configuration disk's.
func restoredConfig(r *Restore) (Config, error) {
	if r.Config == nil {
		return rereadConfig()
	}
	if len(r.Config.Argv) == 0 {
		return Config{}, errors.New("bad workload configuration: no command")
	}
	return *r.Config, nil
}

// rereadConfig reads the configuration disk anew: the restored VM's own, which the agent
// attached in the place of the snapshot's. The block cache still holds the snapshot's, so it
// is dropped first (of that disk alone: the base and writable disks are mounted, and their
// caches hold what the restored file systems run on).
func rereadConfig() (Config, error) {
	devs, _ := filepath.Glob("/dev/vd*")
	for _, d := range devs {
		if l := ext4Label(d); l == BaseLabel || l == WritableLabel || isVolumeDevice(d) {
			continue // the mounted disks: their caches are the file systems' own
		}
		f, err := os.Open(d)
		if err != nil {
			continue
		}
		_ = unix.IoctlSetInt(int(f.Fd()), unix.BLKFLSBUF, 0)
		f.Close()
		switch cfg, err := readConfigDisk(d); {
		case err == nil:
			return cfg, nil
		case !errors.Is(err, ErrNotConfigDisk):
			return Config{}, fmt.Errorf("configuration disk %s: %w", d, err)
		}
	}
	return Config{}, fmt.Errorf("no configuration disk among %v", devs)
}

// moveNet moves the interface with old's MAC to n: its MAC, MTU, address and default route.
// Taking it down drops its neighbours and every address the old identity had.
func moveNet(old, n *Net) error {
	oldMAC, err := net.ParseMAC(old.MAC)
	if err != nil {
		return err
	}
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("network interface MAC %q: %w", n.MAC, err)
	}
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("listing network interfaces: %w", err)
	}
	var link netlink.Link
	for _, l := range links {
		if l.Attrs().HardwareAddr.String() == oldMAC.String() {
			link = l
		}
	}
	if link == nil {
		return fmt.Errorf("no network interface with MAC %s", oldMAC)
	}
	if err := netlink.LinkSetDown(link); err != nil {
		return err
	}
	if err := netlink.LinkSetHardwareAddr(link, mac); err != nil {
		return fmt.Errorf("setting the MAC: %w", err)
	}
	addrs, err := netlink.AddrList(link, netlink.FAMILY_V4)
	if err != nil {
		return err
	}
	for i := range addrs {
		if err := netlink.AddrDel(link, &addrs[i]); err != nil {
			return fmt.Errorf("removing address %s: %w", addrs[i].IPNet, err)
		}
	}
	return configureNet(n, 0)
}

// retoken makes token the channel's, and the hello a new host connection is told carries it.
func (c *channel) retoken(token string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.token = token
	for i, line := range c.history {
		var m Message
		if json.Unmarshal(line, &m) == nil && m.Event == "hello" {
			m.Token = token
			if b, err := json.Marshal(m); err == nil {
				c.history[i] = append(b, '\n')
			}
		}
	}
	c.probes = nil // the new probes report afresh
}

// currentToken is the channel's token as it stands.
func (c *channel) currentToken() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.token
}
