package guestinit

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The workload's cgroup: everything imp-init starts (the workload, exec'd commands, exec
// probes) starts in it (clone3 into the cgroup, so no child runs a moment outside), and a
// snapshot freezes it whole, with every other cgroup but imp-init's own (a workload that runs
// a container engine makes cgroups of its own beside it) and after moving into it any process
// that left for the root cgroup. A snapshot taken with the workload frozen holds no instruction
// of it that a copy would run before the copy is itself: a copy's imp-init takes on its
// identity (clock, fresh entropy and a reseed of the kernel's generator, configuration,
// network, hostname) and only then thaws it, so the workload's first draw from the kernel
// after the restore is the copy's own. The source thaws once its snapshot is saved.
const (
	cgroupRoot     = "/sys/fs/cgroup"
	workloadCgroup = cgroupRoot + "/imp-workload"
	initCgroup     = "imp-init"
)

// workload is the workload's cgroup, a descriptor of its directory (kept across the switch into
// the overlay root), or nil when this kernel gave none: the workload then runs unfreezable, and
// the guest's hello does not offer to freeze it.
var workload *os.File

// makeWorkloadCgroup mounts the cgroup2 hierarchy, makes the workload's cgroup and moves
// imp-init into a cgroup of its own, which no freeze touches.
func makeWorkloadCgroup() error {
	if err := unix.Mount("cgroup2", cgroupRoot, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mounting cgroup2 at %s: %w", cgroupRoot, err)
	}
	for _, d := range []string{workloadCgroup, filepath.Join(cgroupRoot, initCgroup)} {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("making cgroup %s: %w", d, err)
		}
	}
	if _, err := os.Stat(filepath.Join(workloadCgroup, "cgroup.freeze")); err != nil {
		return fmt.Errorf("the workload's cgroup cannot freeze: %w", err)
	}
	if err := os.WriteFile(filepath.Join(cgroupRoot, initCgroup, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		return fmt.Errorf("moving imp-init into its cgroup: %w", err)
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

// frozenByInit are the top-level cgroups (names) the last freeze froze, which a thaw thaws;
// freezes and thaws (from the channel's connections and a restore) take turns on freezing.
var (
	freezing     sync.Mutex
	frozenByInit []string
)

// freezeWorkload freezes every cgroup but imp-init's, after moving any process of the root
// cgroup (but the kernel's threads) into the workload's, and says whether every task of them
// stopped and none is left outside.
func freezeWorkload() bool {
	if workload == nil {
		return false
	}
	freezing.Lock()
	defer freezing.Unlock()
	root, err := os.Open(cgroupRoot)
	if err != nil {
		return false
	}
	defer root.Close()
	if adoptStrays() != nil {
		return false
	}
	names, _ := root.Readdirnames(-1)
	frozenByInit = frozenByInit[:0]
	for _, n := range names {
		if n == initCgroup {
			continue
		}
		if setFrozen(int(root.Fd()), n, true) == nil { // a file, not a cgroup, refuses it
			frozenByInit = append(frozenByInit, n)
		}
	}
	deadline := time.Now().Add(freezeTimeout)
	for {
		if allFrozen(int(root.Fd()), frozenByInit) {
			if s, _ := strays(); len(s) == 0 {
				return true
			}
		}
		if time.Now().After(deadline) {
			thaw(int(root.Fd()))
			return false
		}
		time.Sleep(time.Millisecond)
	}
}

// allFrozen says whether each cgroup of names reports itself frozen.
func allFrozen(root int, names []string) bool {
	for _, n := range names {
		b, err := readAt(root, n+"/cgroup.events")
		if err != nil || !bytes.Contains(b, []byte("frozen 1")) {
			return false
		}
	}
	return true
}

// thawWorkload thaws what the last freeze froze (a no-op when nothing is frozen).
func thawWorkload() {
	if workload == nil {
		return
	}
	freezing.Lock()
	defer freezing.Unlock()
	root, err := os.Open(cgroupRoot)
	if err != nil {
		return
	}
	defer root.Close()
	thaw(int(root.Fd()))
}

// thaw is thawWorkload with freezing held and the hierarchy's root open.
func thaw(root int) {
	for _, n := range append(frozenByInit, filepath.Base(workloadCgroup)) {
		if err := setFrozen(root, n, false); err != nil && !errors.Is(err, unix.ENOENT) {
			fmt.Fprintf(os.Stderr, "imp-init: thawing cgroup %s: %v\n", n, err)
		}
	}
	frozenByInit = frozenByInit[:0]
}

// strays are the processes of the root cgroup that are not kernel threads.
func strays() ([]int, error) {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil {
			continue
		}
		cg, err := os.ReadFile("/proc/" + p.Name() + "/cgroup")
		if err != nil || strings.TrimSpace(string(cg)) != "0::/" || kernelThread(pid) {
			continue
		}
		out = append(out, pid)
	}
	return out, nil
}

// pfKthread is PF_KTHREAD, a kernel thread's flag in /proc/<pid>/stat.
const pfKthread = 0x00200000

func kernelThread(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return true // gone
	}
	rest := b[bytes.LastIndexByte(b, ')')+1:] // the name may hold anything
	f := strings.Fields(string(rest))
	if len(f) < 7 {
		return false
	}
	flags, _ := strconv.ParseUint(f[6], 10, 64) // state ppid pgrp session tty_nr tpgid flags
	return flags&pfKthread != 0
}

// adoptStrays moves the root cgroup's processes into the workload's.
func adoptStrays() error {
	s, err := strays()
	if err != nil {
		return err
	}
	for _, pid := range s {
		if err := os.WriteFile(filepath.Join(workloadCgroup, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("moving process %d into the workload's cgroup: %w", pid, err)
		}
	}
	return nil
}

func readAt(dir int, name string) ([]byte, error) {
	fd, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	b := make([]byte, 256)
	n, err := unix.Read(fd, b)
	return b[:max(n, 0)], err
}

// setFrozen writes the cgroup name's (under the directory root) cgroup.freeze.
func setFrozen(root int, name string, frozen bool) error {
	v := "0"
	if frozen {
		v = "1"
	}
	fd, err := unix.Openat(root, name+"/cgroup.freeze", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(v))
	return err
}
