package guestinit

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// The workload's cgroup: everything imp-init starts (the workload, exec'd commands, exec
// probes) starts in it (clone3 into the cgroup, so no child runs a moment outside), and a
// snapshot freezes it whole. A snapshot taken with the workload frozen holds no instruction of
// it that a copy would run before the copy is itself: a copy's imp-init takes on its identity
// (clock, fresh entropy and a reseed of the kernel's generator, configuration, network,
// hostname) and only then thaws it, so the workload's first draw from the kernel after the
// restore is the copy's own. The source thaws once its snapshot is saved.
const (
	cgroupRoot     = "/sys/fs/cgroup"
	workloadCgroup = cgroupRoot + "/imp-workload"
)

// workload is the workload's cgroup, a descriptor of its directory (kept across the switch into
// the overlay root), or nil when this kernel gave none: the workload then runs unfreezable, and
// the guest's hello does not offer to freeze it.
var workload *os.File

// makeWorkloadCgroup mounts the cgroup2 hierarchy and makes the workload's cgroup.
func makeWorkloadCgroup() error {
	if err := unix.Mount("cgroup2", cgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mounting cgroup2 at %s: %w", cgroupRoot, err)
	}
	if err := os.Mkdir(workloadCgroup, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("making the workload's cgroup: %w", err)
	}
	if _, err := os.Stat(filepath.Join(workloadCgroup, "cgroup.freeze")); err != nil {
		return fmt.Errorf("the workload's cgroup cannot freeze: %w", err)
	}
	f, err := os.Open(workloadCgroup)
	if err != nil {
		return err
	}
	workload = f
	return nil
}

// freezeTimeout bounds how long a freeze waits for every task of the workload to stop (one in
// an uninterruptible sleep holds it up): past it, the freeze is undone and not reported.
const freezeTimeout = time.Second

// freezeWorkload freezes the workload's cgroup and says whether every task of it stopped.
func freezeWorkload() bool {
	if workload == nil {
		return false
	}
	if setFrozen(true) != nil {
		return false
	}
	deadline := time.Now().Add(freezeTimeout)
	for {
		ev, err := unix.Openat(int(workload.Fd()), "cgroup.events", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err == nil {
			b := make([]byte, 256)
			n, _ := unix.Read(ev, b)
			unix.Close(ev)
			if bytes.Contains(b[:max(n, 0)], []byte("frozen 1")) {
				return true
			}
		}
		if time.Now().After(deadline) {
			_ = setFrozen(false)
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// thawWorkload lets the workload run again (a no-op when it is not frozen).
func thawWorkload() {
	if workload != nil {
		if err := setFrozen(false); err != nil {
			fmt.Fprintln(os.Stderr, "imp-init: thawing the workload:", err)
		}
	}
}

func setFrozen(frozen bool) error {
	v := "0"
	if frozen {
		v = "1"
	}
	fd, err := unix.Openat(int(workload.Fd()), "cgroup.freeze", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(v))
	return err
}
