package fctest

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// MountsEnv names the file the fake jailer reads instead of /proc/mounts to find cgroup
// hierarchies: a test that must not touch the host's cgroups points it at a tree of its own.
const MountsEnv = "IMP_FAKE_JAILER_MOUNTS"

// GuestDisksFile is the file, at the jail's root, where the fake lists what /disks held as its
// guest started.
const GuestDisksFile = "guest-disks.txt"

// StuckGuestEnv, set, makes the fake's guest say nothing at all, as one whose boot stalls.
const StuckGuestEnv = "IMP_FAKE_GUEST_STUCK"

// jailerDevice is a device node the jailer makes in every jail (jailer.md, "Jailer
// Operation"; /dev/urandom and /dev/userfaultfd as v1.16's jailer makes them too).
type jailerDevice struct {
	path         string
	major, minor uint32
	hostOnly     bool // made only where the host has it, with the host's numbers
}

var jailerDevices = []jailerDevice{
	{"/dev/net/tun", 10, 200, false},
	{"/dev/kvm", 10, 232, false},
	{"/dev/urandom", 1, 9, false},
	{"/dev/userfaultfd", 10, 126, true},
}

var jailID = regexp.MustCompile(`^[a-zA-Z0-9-]{1,64}$`)

// FakeJailer stands in for Firecracker's jailer, doing what jailer.md says the real one does,
// in its order, and failing where it fails:
//
//   - validates the id (alphanumerics and hyphens, at most 64) and the exec file;
//   - creates <chroot base>/<exec file name>/<id>/root when absent (nothing else is refused);
//   - copies the exec file into the jail as /<exec file name>;
//   - creates <hierarchy>/<parent cgroup>/<id> in each hierarchy a --cgroup names (found in
//     /proc/mounts, or MountsEnv's file), writes its pid and the values, and fails as the real
//     one does when a controller has no hierarchy;
//   - chroots into the jail (the real one pivots its root in a new mount namespace: the same
//     view for the VMM);
//   - mknods /dev/net/tun, /dev/kvm, /dev/urandom (and /dev/userfaultfd where the host has it)
//     and fails, as the real one exits, when one exists: "Failed to create /dev/net/tun via
//     mknod inside the jail: File exists (os error 17)";
//   - chowns them and the jail's root to --uid/--gid;
//   - joins --netns (the exec'd VMM runs in it);
//   - with --daemonize, starts a session and points stdio at /dev/null;
//   - drops privileges to --uid/--gid and execs /<exec file name> with --id, --start-time-us,
//     --start-time-cpu-us and --parent-cpu-time-us, then what followed "--".
//
// The exec file must be a static binary that runs FakeFirecracker for those arguments (the
// fakejailer command does both). The environment is cleared but for IMP_FAKE_* (the fakes'
// knobs). Not modelled: --new-pid-ns, --resource-limit's effect (it is parsed), closing
// inherited descriptors, a new mount namespace (a chroot gives the VMM the same view).
func FakeJailer(args []string) int {
	if len(args) == 1 && args[0] == "--version" {
		fmt.Println("Jailer v1.16.1")
		return 0
	}
	if IsFirecrackerArgs(args) {
		return FakeFirecracker(args)
	}
	fs := flag.NewFlagSet("jailer", flag.ContinueOnError)
	id := fs.String("id", "", "")
	execFile := fs.String("exec-file", "", "")
	base := fs.String("chroot-base-dir", "/srv/jailer", "")
	uid := fs.Int("uid", -1, "")
	gid := fs.Int("gid", -1, "")
	version := fs.String("cgroup-version", "1", "")
	parent := fs.String("parent-cgroup", "", "")
	netns := fs.String("netns", "", "")
	daemonize := fs.Bool("daemonize", false, "")
	newPIDNS := fs.Bool("new-pid-ns", false, "")
	var cgroups []string
	fs.Func("cgroup", "", func(v string) error { cgroups = append(cgroups, v); return nil })
	fs.Func("resource-limit", "", func(string) error { return nil })
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(format string, a ...any) int {
		// The real jailer panics with its error: Rust's exit code 101.
		fmt.Fprintf(os.Stderr, "thread 'main' panicked at src/jailer/src/main.rs:347:27:\nJailer error: "+format+"\n", a...)
		return 101
	}
	switch {
	case !jailID.MatchString(*id):
		return fail("Invalid instance ID: %s", *id)
	case *uid < 0 || *gid < 0:
		return fail("Missing argument: uid and gid")
	case *newPIDNS:
		return fail("the fake jailer does not model --new-pid-ns")
	}
	execName := filepath.Base(*execFile)
	if fi, err := os.Stat(*execFile); err != nil || !fi.Mode().IsRegular() {
		return fail("Failed to canonicalize path %s: %v", *execFile, err)
	}
	if *parent == "" {
		*parent = execName
	}
	chroot := filepath.Join(*base, execName, *id, "root")
	if err := os.MkdirAll(chroot, 0o755); err != nil {
		return fail("Failed to create the jail's root folder %s: %v", chroot, err)
	}
	if err := copyFile(*execFile, filepath.Join(chroot, execName)); err != nil {
		return fail("Failed to copy %s into the jail: %v", *execFile, err)
	}
	if err := joinCgroups(*version, *parent, *id, cgroups); err != nil {
		return fail("%v", err)
	}
	devices := make([]jailerDevice, 0, len(jailerDevices))
	for _, d := range jailerDevices {
		if d.hostOnly {
			// Made as the host's is (userfaultfd's minor is the kernel's to choose), or not at all.
			var st unix.Stat_t
			if unix.Stat(d.path, &st) != nil {
				continue
			}
			d.major, d.minor = unix.Major(st.Rdev), unix.Minor(st.Rdev)
		}
		devices = append(devices, d)
	}
	var ns *os.File // opened on the host, joined from the jail
	if *netns != "" {
		var err error
		if ns, err = os.Open(*netns); err != nil {
			return fail("Failed to open the network namespace %s: %v", *netns, err)
		}
		defer ns.Close()
	}
	if err := syscall.Chroot(chroot); err != nil {
		return fail("Failed to chroot into %s: %v", chroot, err)
	}
	if err := os.Chdir("/"); err != nil {
		return fail("Failed to change into the jail's root: %v", err)
	}
	for _, d := range devices {
		if err := mknod(d, *uid, *gid); err != nil {
			return fail("%v", err)
		}
	}
	if err := os.Chown("/", *uid, *gid); err != nil {
		return fail("Failed to change the owner of the jail's root: %v", err)
	}
	// Everything below runs on this thread, which execs: its network namespace is the VMM's.
	runtime.LockOSThread()
	if ns != nil {
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			return fail("Failed to join the network namespace %s: %v", *netns, err)
		}
	}
	if *daemonize {
		if _, err := syscall.Setsid(); err != nil {
			return fail("Failed to start a session: %v", err)
		}
		null, err := os.OpenFile("/dev/null", os.O_RDWR, 0)
		if err == nil {
			for _, fd := range []int{0, 1, 2} {
				_ = unix.Dup2(int(null.Fd()), fd)
			}
			null.Close()
		}
	}
	if err := syscall.Setgroups(nil); err != nil {
		return fail("Failed to drop supplementary groups: %v", err)
	}
	if err := syscall.Setgid(*gid); err != nil {
		return fail("Failed to set gid %d: %v", *gid, err)
	}
	if err := syscall.Setuid(*uid); err != nil {
		return fail("Failed to set uid %d: %v", *uid, err)
	}
	now := strconv.FormatInt(time.Now().UnixMicro(), 10)
	argv := append([]string{"/" + execName, "--id=" + *id, "--start-time-us=" + now, "--start-time-cpu-us=0", "--parent-cpu-time-us=0"}, fs.Args()...)
	// The environment is cleared, as the real jailer's is, but for the fakes' test knobs.
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "IMP_FAKE_") {
			env = append(env, kv)
		}
	}
	err := syscall.Exec("/"+execName, argv, env)
	return fail("Failed to exec into %s: %v", execName, err)
}

// IsFirecrackerArgs: args are what the jailer passes the VMM it execs.
func IsFirecrackerArgs(args []string) bool {
	for _, a := range args {
		if strings.HasPrefix(a, "--start-time-us") {
			return true
		}
	}
	return false
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	_ = os.Remove(dst)
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// mknod makes d in the jail (the current root) and hands it to uid:gid; an existing node is
// the real jailer's fatal error.
func mknod(d jailerDevice, uid, gid int) error {
	if err := os.MkdirAll(filepath.Dir(d.path), 0o755); err != nil {
		return fmt.Errorf("Failed to create %s inside the jail: %v", filepath.Dir(d.path), err) //nolint:staticcheck // the jailer's message
	}
	if err := unix.Mknod(d.path, unix.S_IFCHR|unix.S_IRUSR|unix.S_IWUSR, int(unix.Mkdev(d.major, d.minor))); err != nil {
		var errno syscall.Errno
		if errors.As(err, &errno) {
			return fmt.Errorf("Failed to create %s via mknod inside the jail: %s (os error %d)", d.path, capitalized(errno.Error()), int(errno)) //nolint:staticcheck // the jailer's message
		}
		return err
	}
	if err := os.Chown(d.path, uid, gid); err != nil {
		return fmt.Errorf("Failed to change the owner of %s: %v", d.path, err) //nolint:staticcheck // the jailer's message
	}
	return nil
}

func capitalized(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// joinCgroups creates <hierarchy>/<parent>/<id> for each controller the values name, sets the
// values and moves this process there: the jailer's cgroup setup.
func joinCgroups(version, parent, id string, values []string) error {
	if len(values) == 0 {
		return nil
	}
	mounts := os.Getenv(MountsEnv)
	if mounts == "" {
		mounts = "/proc/mounts"
	}
	hier, unified, err := cgroupMounts(mounts)
	if err != nil {
		return err
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, v := range values {
		file, value, ok := strings.Cut(v, "=")
		controller, _, _ := strings.Cut(file, ".")
		if !ok || controller == "" {
			return fmt.Errorf("Invalid cgroup argument: %s", v) //nolint:staticcheck // the jailer's message
		}
		var dir string
		switch version {
		case "1":
			mnt, ok := hier[controller]
			if !ok {
				return fmt.Errorf("Cgroup error: Controller %s is unavailable", controller) //nolint:staticcheck // the jailer's message
			}
			dir = filepath.Join(mnt, parent, id)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return fmt.Errorf("Cgroup error: creating %s: %v", dir, err) //nolint:staticcheck // the jailer's message
			}
			// The real jailer, of one thread, writes tasks; this one has several, and the one
			// that execs must move too: cgroup.procs moves them all.
			if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0o644); err != nil {
				return fmt.Errorf("Cgroup error: writing the pid to %s: %v", dir, err) //nolint:staticcheck // the jailer's message
			}
		case "2":
			if unified == "" {
				return errors.New("Cgroup error: no cgroup v2 hierarchy is mounted") //nolint:staticcheck // the jailer's message
			}
			ctrls, _ := os.ReadFile(filepath.Join(unified, "cgroup.controllers"))
			if !contains(strings.Fields(string(ctrls)), controller) {
				return fmt.Errorf("Cgroup error: Controller %s is unavailable", controller) //nolint:staticcheck // the jailer's message
			}
			// Each level down to the VM's delegates the controller.
			dir = unified
			for _, part := range strings.Split(filepath.Join(parent, id), "/") {
				if err := appendFile(filepath.Join(dir, "cgroup.subtree_control"), "+"+controller); err != nil {
					return fmt.Errorf("Cgroup error: enabling %s under %s: %v", controller, dir, err) //nolint:staticcheck // the jailer's message
				}
				dir = filepath.Join(dir, part)
				if err := os.MkdirAll(dir, 0o755); err != nil {
					return fmt.Errorf("Cgroup error: creating %s: %v", dir, err) //nolint:staticcheck // the jailer's message
				}
			}
			if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0o644); err != nil {
				return fmt.Errorf("Cgroup error: writing the pid to %s: %v", dir, err) //nolint:staticcheck // the jailer's message
			}
		default:
			return fmt.Errorf("Invalid cgroup version: %s", version) //nolint:staticcheck // the jailer's message
		}
		if err := os.WriteFile(filepath.Join(dir, file), []byte(value), 0o644); err != nil {
			return fmt.Errorf("Cgroup error: writing %s: %v", filepath.Join(dir, file), err) //nolint:staticcheck // the jailer's message
		}
	}
	return nil
}

func appendFile(p, line string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(line); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// cgroupMounts reads a mounts file: each v1 controller's hierarchy, and the unified one.
func cgroupMounts(path string) (v1 map[string]string, unified string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, "", fmt.Errorf("Cgroup error: reading %s: %v", path, err) //nolint:staticcheck // the jailer's message
	}
	defer f.Close()
	v1 = map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 4 {
			continue
		}
		switch fields[2] {
		case "cgroup2":
			unified = fields[1]
		case "cgroup":
			for _, o := range strings.Split(fields[3], ",") {
				switch o {
				case "rw", "ro", "nosuid", "nodev", "noexec", "relatime":
				default:
					v1[o] = fields[1]
				}
			}
		}
	}
	return v1, unified, sc.Err()
}
