package guestinit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// OS mode (Config.OS, ImpVM spec.boot OS): imp-init prepares the guest as it prepares a
// workload's (modules, disks, the overlay root, network, hostname, volumes), then hands PID 1
// to the image's own init and comes back as a service of it, the guest side: the guest
// channel, exec sessions, probes and the VM's readiness (docs/os.md).
const (
	// GuestSideArg is imp-init's argument when the OS's init starts it as the guest side.
	GuestSideArg = "guest"
	// osInit is the image's init, PID 1 of an OS-mode guest.
	osInit = "/sbin/init"
	// guestSideDir holds, on the tmpfs imp-init mounts on the OS's /run, the guest side's
	// binary and state: root's alone.
	guestSideDir   = "/run/imp"
	guestSideState = guestSideDir + "/guest.json"
	guestSideBin   = guestSideDir + "/imp-init"
	// guestSideKeys records the users the guest side gave SSH keys (keys_linux.go), on the
	// OS's disk: a restart of the VM keeps it.
	guestSideKeys = "/var/lib/imp/keys.users"
	// guestSideUnit is the runtime unit (in /run, gone at the next boot) that starts the
	// guest side early in the OS's boot, and again if it ends.
	guestSideUnit = "/run/systemd/system/imp-guest.service"
)

// guestSide is what imp-init hands the guest side across the exec of the OS's init.
type guestSide struct {
	Token     string `json:"token"`
	Transport string `json:"transport,omitempty"`
	Config    Config `json:"config"`
	Net       *Net   `json:"net,omitempty"`
	Boot      Boot   `json:"boot"`
}

const unitText = `[Unit]
Description=IMP guest side: exec, probes and readiness for the node's agent
DefaultDependencies=no
Before=sysinit.target shutdown.target
Conflicts=shutdown.target

[Service]
ExecStart=` + guestSideBin + ` ` + GuestSideArg + `
Restart=always
RestartSec=1
`

// handOver makes the OS's init PID 1: the guest side's binary, state and unit on a tmpfs at
// /run (systemd keeps a /run it finds mounted), cloud-init off until IMP gives it a seed
// (its fallback would replace the network imp-init configured), the channel flushed, then
// the exec. It returns only on failure.
func handOver(cfg Config, gnet *Net, transport string) (int, error) {
	if _, err := os.Stat(osInit); err != nil {
		return ch.fail(fmt.Errorf("boot OS: the image has no %s: %w", osInit, err))
	}
	if err := unix.Mount("tmpfs", "/run", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return ch.fail(fmt.Errorf("mounting /run: %w", err))
	}
	if err := os.MkdirAll(guestSideDir, 0o700); err != nil {
		return ch.fail(err)
	}
	if err := copyFile("/proc/self/exe", guestSideBin, 0o700); err != nil {
		return ch.fail(fmt.Errorf("copying imp-init for the guest side: %w", err))
	}
	phase("workload")
	state := guestSide{Config: cfg, Net: gnet, Boot: boot, Transport: transport}
	if ch != nil {
		state.Token = ch.currentToken()
	}
	data, err := json.Marshal(state)
	if err != nil {
		return ch.fail(err)
	}
	if err := os.WriteFile(guestSideState, data, 0o600); err != nil {
		return ch.fail(err)
	}
	wants := filepath.Join(filepath.Dir(guestSideUnit), "sysinit.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		return ch.fail(err)
	}
	if err := os.WriteFile(guestSideUnit, []byte(unitText), 0o644); err != nil {
		return ch.fail(err)
	}
	if err := os.Symlink("../"+filepath.Base(guestSideUnit), filepath.Join(wants, filepath.Base(guestSideUnit))); err != nil {
		return ch.fail(err)
	}
	if cfg.Hostname != "" {
		if err := replaceFile("/etc/hostname", cfg.Hostname+"\n"); err != nil {
			return ch.fail(err)
		}
	}
	if err := configureCloudInit(cfg); err != nil {
		return ch.fail(err)
	}
	if err := leaveCgroups(); err != nil {
		fmt.Fprintln(os.Stderr, "imp-init:", err)
	}
	ch.flush(5 * time.Second)
	fmt.Fprintln(os.Stderr, "imp-init: handing over to", osInit)
	err = unix.Exec(osInit, []string{osInit}, []string{"TERM=linux"})
	return -1, fmt.Errorf("executing %s: %w", osInit, err)
}

// cloudInitNetworkOff keeps cloud-init off the network imp-init configured (its fallback is
// DHCP on the first interface).
const cloudInitNetworkOff = "/etc/cloud/cloud.cfg.d/99-imp-network.cfg"

// configureCloudInit turns an image's cloud-init off when the VM has no seed (its datasource
// search would wait for ones that are not there, its fallback replace the network); with a
// seed, it keeps cloud-init off the network unless the seed configures it.
func configureCloudInit(cfg Config) error {
	if fi, err := os.Stat("/etc/cloud"); err != nil || !fi.IsDir() {
		return nil // no cloud-init in the image
	}
	if !cfg.CloudInit {
		return os.WriteFile("/etc/cloud/cloud-init.disabled", nil, 0o644)
	}
	_ = os.Remove("/etc/cloud/cloud-init.disabled") // a seed now, where a boot before had none
	if cfg.CloudInitNetwork {
		_ = os.Remove(cloudInitNetworkOff)
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(cloudInitNetworkOff), 0o755); err != nil {
		return err
	}
	return os.WriteFile(cloudInitNetworkOff, []byte("# Written by IMP: the VM's network is IMP's (no networkData in spec.cloudInit).\nnetwork: {config: disabled}\n"), 0o644)
}

// leaveCgroups puts PID 1 back in the root cgroup and removes imp-init's two: under systemd
// the cgroups are the OS's.
func leaveCgroups() error {
	if workload == nil {
		return nil
	}
	_ = workload.Close()
	workload = nil
	if err := os.WriteFile(filepath.Join(cgroupRoot, "cgroup.procs"), []byte("1"), 0); err != nil {
		return fmt.Errorf("leaving imp-init's cgroup: %w", err)
	}
	return errors.Join(unix.Rmdir(workloadCgroup), unix.Rmdir(filepath.Join(cgroupRoot, initCgroup)))
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// RunGuestSide is imp-init started by the OS's init (GuestSideArg): it opens the guest
// channel again (the agent takes the new hello as the same run's), serves exec sessions, says
// ready once the OS is up, and runs the probes. It returns when the OS stops it.
func RunGuestSide() error {
	data, err := os.ReadFile(guestSideState)
	if err != nil {
		return fmt.Errorf("the guest side's state: %w", err)
	}
	var st guestSide
	if err := json.Unmarshal(data, &st); err != nil {
		return fmt.Errorf("the guest side's state: %w", err)
	}
	// Orphans of exec'd commands come back to it, not to the OS's init.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	boot = st.Boot
	ch, err = openChannel(st.Token, st.Transport)
	if err != nil {
		return fmt.Errorf("the guest channel: %w", err)
	}
	live.configure(st.Config, st.Net)
	keys := &keyWriter{root: "/", given: guestSideKeys}
	sessionKeys = keys.give
	serveSessions()
	go reapAll()
	ch.serve()
	ready := Message{Event: "ready"}
	if state, err := osRunning(context.Background()); err != nil {
		ready = Message{Event: "error", Message: err.Error()}
	} else if state != "running" {
		fmt.Fprintln(os.Stderr, "imp-init guest side: the OS is up,", state)
	}
	if ready.Event == "ready" {
		phase("")
		boot.Ready = bootClock()
		ready.Boot = &boot
	}
	ch.send(ready)
	live.runProbes(st.Config)
	select {} // until the OS stops the service
}

// osRunning waits until the OS's boot is over and returns its state: running, or degraded
// (a unit failed; the OS is up all the same). Any other (maintenance, stopping) is an error.
func osRunning(ctx context.Context) (string, error) {
	out, _ := exec.CommandContext(ctx, "systemctl", "is-system-running", "--wait").Output()
	state := strings.TrimSpace(string(out))
	switch state {
	case "running", "degraded":
		return state, nil
	}
	return state, fmt.Errorf("the OS did not come up: systemctl is-system-running says %q", state)
}

// powerOff asks the OS to power off (a failed startup or liveness probe ends an OS-mode run).
func powerOff() {
	_ = exec.Command("systemctl", "poweroff", "--no-block").Run()
}
