package firecracker_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest"
	"github.com/syscode-labs/imp/internal/agent/volume/loop"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/testnetns"
)

// TestMain lets the test binary stand in for the jailer (IMP_FAKE_JAILER=1): see
// fctest.FakeJailer.
func TestMain(m *testing.M) {
	if os.Getenv("IMP_FAKE_JAILER") == "1" {
		os.Exit(fctest.FakeJailer(os.Args[1:]))
	}
	// The VMM the jailer copies into the jail and execs there: a static fake Firecracker.
	dir, err := os.MkdirTemp("", "fake-firecracker-")
	if err != nil {
		panic(err)
	}
	fakeFirecracker = filepath.Join(dir, "firecracker")
	build := exec.Command("go", "build", "-o", fakeFirecracker, "github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest/fakejailer")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the fake Firecracker: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// fakeFirecracker is the static fake Firecracker binary (TestMain).
var fakeFirecracker string

// fakeCgroups points the fake jailer at a cgroup v2 tree of the test's own, with the cpu and
// memory controllers, so that it creates the VM's cgroup there and not on the host.
// fakeJailer makes this test binary, run again, the jailer (TestMain) and returns its path.
func fakeJailer(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("IMP_FAKE_JAILER", "1")
	return self
}

func fakeCgroups(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("cpu memory\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	mounts := filepath.Join(t.TempDir(), "mounts")
	if err := os.WriteFile(mounts, []byte("cgroup2 "+root+" cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(fctest.MountsEnv, mounts)
	return root
}

var tapSeq atomic.Int32

func spec(t *testing.T) firecracker.Spec {
	t.Helper()
	dir := t.TempDir()
	for _, f := range []string{"vmlinuz", "initramfs.cpio.gz", "base.ext4", "rw.ext4", "config.img"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte(f), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	_ = os.Chmod(filepath.Join(dir, "base.ext4"), 0o444)
	vmDir := filepath.Join(dir, "vm")
	_ = os.Mkdir(vmDir, 0o700)
	// The VM's tap, persistent and the jail's uid's, in a network namespace of the test's own
	// (the jailer joins it): Firecracker opens it by name, and refuses a tap it cannot open.
	ns := testnetns.New(t, "imp-fc-"+strconv.Itoa(int(tapSeq.Add(1))))
	if err := testnetns.Do(ns, func() error {
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		ifr, err := unix.NewIfreq("impt0123456789")
		if err != nil {
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			return err
		}
		if err := unix.IoctlSetInt(fd, unix.TUNSETOWNER, 31001); err != nil {
			return err
		}
		return unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1)
	}); err != nil {
		t.Fatalf("making the VM's tap: %v", err)
	}
	return firecracker.Spec{NetNS: ns,
		ID: "5f1c0a44-0d7e-4d3e-9a8e-2f6b1c9d0e11", Dir: vmDir,
		Firecracker: "/usr/local/bin/firecracker", Jailer: "/usr/local/bin/jailer",
		UID: 31001, GID: 31001, ChrootBase: filepath.Join(dir, "jail"), CgroupVersion: 2,
		Kernel: filepath.Join(dir, "vmlinuz"), Initramfs: filepath.Join(dir, "initramfs.cpio.gz"),
		BaseDisk: filepath.Join(dir, "base.ext4"), WritableDisk: filepath.Join(dir, "rw.ext4"), ConfigDisk: filepath.Join(dir, "config.img"),
		VCPUs: 2, MemoryMiB: 256, Token: "t0k", Tap: "impt0123456789",
		Net: &guestinit.Net{Address: netip.MustParsePrefix("10.1.0.5/24"), Gateway: netip.MustParseAddr("10.1.0.1"), MTU: 1450, MAC: "0a:58:0a:01:00:05"},
	}
}

func TestJailerArgs(t *testing.T) {
	s := spec(t)
	s.NetNS = "/var/run/netns/node"
	want := []string{
		"--id", s.ID, "--exec-file", "/usr/local/bin/firecracker", "--uid", "31001", "--gid", "31001",
		"--chroot-base-dir", s.ChrootBase, "--cgroup-version", "2",
		"--cgroup", "cpu.max=200000 100000", "--cgroup", fmt.Sprintf("memory.max=%d", (256+64)<<20),
		"--parent-cgroup", "imp", "--netns", "/var/run/netns/node", "--", "--api-sock", "/run/firecracker.socket",
	}
	if got := s.JailerArgs(); !slices.Equal(got, want) {
		t.Errorf("jailer args\n got %q\nwant %q", got, want)
	}
	s.CgroupVersion, s.NetNS = 1, ""
	got := strings.Join(s.JailerArgs(), " ")
	for _, w := range []string{"--cgroup-version 1", "--cgroup cpu.cfs_quota_us=200000", "--cgroup memory.limit_in_bytes=335544320"} {
		if !strings.Contains(got, w) || strings.Contains(got, "--netns") {
			t.Errorf("cgroup v1 args lack %q or keep --netns: %s", w, got)
		}
	}
	// A warm pool member's weight, a tenth of a VM's, in the cgroup the jailer makes.
	s.Weight = cgroup.BackgroundWeight
	if got := strings.Join(s.JailerArgs(), " "); !strings.Contains(got, "--cgroup cpu.shares=102 --parent-cgroup imp") {
		t.Errorf("cgroup v1 weight: %s", got)
	}
	s.CgroupVersion = 2
	if got := strings.Join(s.JailerArgs(), " "); !strings.Contains(got, "--cgroup cpu.weight=10 --parent-cgroup imp") {
		t.Errorf("cgroup v2 weight: %s", got)
	}
	if root := s.ChrootDir(); root != filepath.Join(s.ChrootBase, "firecracker", s.ID, "root") {
		t.Errorf("chroot %s", root)
	}
}

// TestChrootLayout: the jail holds exactly the VM's kernel, initramfs, disks, /run and /logs;
// the VM's own files belong to its uid, the shared ones stay root's and read-only.
func TestChrootLayout(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	s := spec(t)
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Fatal(err)
	}
	root := s.ChrootDir()
	owner := map[string]string{}
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		st := fi.Sys().(*syscall.Stat_t)
		owner[rel] = fmt.Sprintf("%d %v", st.Uid, fi.Mode().Perm())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for n := range owner {
		names = append(names, n)
	}
	sort.Strings(names)
	want := []string{".", "boot", "boot/initramfs.cpio.gz", "boot/vmlinuz", "disks", "disks/base.ext4", "disks/config.img", "disks/rw.ext4", "logs", "logs/console.log", "logs/firecracker.log", "logs/metrics.json", "run", "snapshot"}
	if !slices.Equal(names, want) {
		t.Fatalf("jail holds %q, want %q", names, want)
	}
	for n, o := range map[string]string{".": "31001 -rwxr-x---", "disks/rw.ext4": "31001 -rw-r--r--", "run": "31001 -rwxr-x---",
		"disks/base.ext4": "0 -r--r--r--", "boot/vmlinuz": "0 -rw-r--r--", "logs/firecracker.log": "31001 -rw-r-----"} {
		if owner[n] != o {
			t.Errorf("%s: %s, want %s", n, owner[n], o)
		}
	}
	// The base disk in the jail is the shared file itself (a hard link), not a copy.
	a, _ := os.Stat(s.BaseDisk)
	b, _ := os.Stat(filepath.Join(root, "disks/base.ext4"))
	if !os.SameFile(a, b) {
		t.Error("the base disk was copied into the jail")
	}
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Errorf("preparing the jail again: %v", err)
	}
}

// serve starts the double for a test on a socket of its own.
func serve(t *testing.T) (*fctest.Server, *firecracker.Client) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "fc.sock")
	srv, err := fctest.Serve(sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv, firecracker.NewClient(sock)
}

// TestConfigure asserts the VM the double ends up with, not the calls that made it.
func TestConfigure(t *testing.T) {
	srv, c := serve(t)
	s := spec(t)
	s.DiskRate = &firecracker.RateLimiter{Bandwidth: &firecracker.TokenBucket{Size: 50 << 20, RefillTime: 1000}}
	ctx := context.Background()
	if err := firecracker.Configure(ctx, c, s); err != nil {
		t.Fatal(err)
	}
	srv.Lock()
	defer srv.Unlock()
	cfg := srv.Config
	if !srv.Started || srv.Paused {
		t.Errorf("started %v paused %v", srv.Started, srv.Paused)
	}
	check := func(what string, got, want any) {
		t.Helper()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s = %v, want %v", what, got, want)
		}
	}
	check("vcpus", cfg.MachineConfig["vcpu_count"], 2)
	check("memory", cfg.MachineConfig["mem_size_mib"], 256)
	check("kernel", cfg.BootSource["kernel_image_path"], "/boot/vmlinuz")
	check("initrd", cfg.BootSource["initrd_path"], "/boot/initramfs.cpio.gz")
	args := cfg.BootSource["boot_args"].(string)
	for _, w := range []string{"imp.token=t0k", "imp.channel=vsock:1024", "imp.net=10.1.0.5/24,10.1.0.1,1450,0a:58:0a:01:00:05", "console=ttyS0"} {
		if !strings.Contains(args, w) {
			t.Errorf("boot args lack %q: %s", w, args)
		}
	}
	check("base disk", fmt.Sprint(cfg.Drives["base"]["path_on_host"], " ro=", cfg.Drives["base"]["is_read_only"], " root=", cfg.Drives["base"]["is_root_device"]), "/disks/base.ext4 ro=true root=false")
	check("rw disk", fmt.Sprint(cfg.Drives["rw"]["path_on_host"], " ro=", cfg.Drives["rw"]["is_read_only"]), "/disks/rw.ext4 ro=false")
	check("config disk", fmt.Sprint(cfg.Drives["config"]["path_on_host"], " ro=", cfg.Drives["config"]["is_read_only"]), "/disks/config.img ro=true")
	check("rw disk rate", cfg.Drives["rw"]["rate_limiter"], map[string]any{"bandwidth": map[string]any{"size": 52428800.0, "refill_time": 1000.0}})
	check("nic", fmt.Sprint(cfg.NetIfaces["eth0"]["host_dev_name"], " ", cfg.NetIfaces["eth0"]["guest_mac"], " ", cfg.NetIfaces["eth0"]["mtu"]), "impt0123456789 0a:58:0a:01:00:05 1450")
	check("vsock", fmt.Sprint(cfg.Vsock["guest_cid"], " ", cfg.Vsock["uds_path"]), "3 /run/vsock.sock")
	check("logger", cfg.Logger["log_path"], "/logs/firecracker.log")
	check("metrics", cfg.Metrics["metrics_path"], "/logs/metrics.json")
	check("console", cfg.Serial["serial_out_path"], "/logs/console.log")
	if len(srv.Refused) > 0 {
		t.Errorf("refused: %v", srv.Refused)
	}
}

// TestRefusals: the double refuses what Firecracker refuses, and the driver reports the fault.
func TestRefusals(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		setup func(c *firecracker.Client) error
		call  func(c *firecracker.Client) error
		want  string
	}{
		{"configuration after InstanceStart", func(c *firecracker.Client) error { return firecracker.Configure(ctx, c, spec(t)) },
			func(c *firecracker.Client) error {
				return c.Do(ctx, "PUT", "/machine-config", firecracker.MachineConfig{VCPUCount: 4, MemSizeMiB: 512}, nil)
			}, "not supported after starting the microVM"},
		{"snapshot without pause", func(c *firecracker.Client) error { return firecracker.Configure(ctx, c, spec(t)) },
			func(c *firecracker.Client) error { return firecracker.CreateSnapshot(ctx, c, "/s", "/m") }, "pause it first"},
		{"pause before start", nil, func(c *firecracker.Client) error { return firecracker.Pause(ctx, c) }, "not supported before starting"},
		{"snapshot load after configuration", func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/machine-config", firecracker.MachineConfig{VCPUCount: 1, MemSizeMiB: 128}, nil)
		}, func(c *firecracker.Client) error { return firecracker.LoadSnapshot(ctx, c, "/s", "/m", true) }, "not allowed after configuring"},
		{"unknown field", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/machine-config", map[string]any{"vcpu_count": 1, "mem_size_mib": 128, "ht_enabled": true}, nil)
		}, "unknown field `ht_enabled`, expected one of"},
		{"missing required field", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/drives/rw", map[string]any{"drive_id": "rw", "path_on_host": "/d"}, nil)
		}, `missing required field "is_root_device"`},
		{"wrong type", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/machine-config", map[string]any{"vcpu_count": "2", "mem_size_mib": 128}, nil)
		}, `field "vcpu_count": string, want integer`},
		{"bad enum", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PATCH", "/vm", map[string]any{"state": "Sleeping"}, nil)
		}, `"Sleeping" is not one of`},
		{"start without a kernel", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/actions", firecracker.Action{ActionType: "InstanceStart"}, nil)
		}, "without kernel configuration"},
		{"odd vCPUs", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/machine-config", firecracker.MachineConfig{VCPUCount: 3, MemSizeMiB: 128}, nil)
		}, "vCPU number is invalid"},
		{"drive id differs from the path", nil, func(c *firecracker.Client) error {
			return c.Do(ctx, "PUT", "/drives/rw", firecracker.Drive{DriveID: "base", PathOnHost: "/d"}, nil)
		}, "does not match the id from the body"},
		{"unknown path", nil, func(c *firecracker.Client) error { return c.Do(ctx, "PUT", "/balloon", map[string]any{}, nil) }, "Invalid request method and/or path: PUT /balloon"},
		{"unknown method", nil, func(c *firecracker.Client) error { return c.Do(ctx, "DELETE", "/machine-config", nil, nil) }, "Invalid request method and/or path: DELETE /machine-config"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, c := serve(t)
			if tc.setup != nil {
				if err := tc.setup(c); err != nil {
					t.Fatal(err)
				}
			}
			err := tc.call(c)
			var apiErr *firecracker.APIError
			if !errors.As(err, &apiErr) || apiErr.Status != 400 || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got %v, want a refusal containing %q", err, tc.want)
			}
		})
	}
}

// TestPauseSnapshotLoad: a paused VM's snapshot restores the same VM into a fresh Firecracker.
func TestPauseSnapshotLoad(t *testing.T) {
	ctx := context.Background()
	srv, c := serve(t)
	if err := firecracker.Configure(ctx, c, spec(t)); err != nil {
		t.Fatal(err)
	}
	if err := firecracker.Pause(ctx, c); err != nil {
		t.Fatal(err)
	}
	if info, err := firecracker.Info(ctx, c); err != nil || info.State != "Paused" {
		t.Fatalf("info %+v, %v", info, err)
	}
	dir := t.TempDir()
	state, mem := filepath.Join(dir, "state"), filepath.Join(dir, "mem")
	if err := firecracker.CreateSnapshot(ctx, c, state, mem); err != nil {
		t.Fatal(err)
	}
	if err := firecracker.Resume(ctx, c); err != nil {
		t.Fatal(err)
	}
	if info, _ := firecracker.Info(ctx, c); info.State != "Running" {
		t.Errorf("after resume: %s", info.State)
	}

	fresh, c2 := serve(t)
	if err := firecracker.LoadSnapshot(ctx, c2, state, mem, true); err != nil {
		t.Fatal(err)
	}
	srv.Lock()
	fresh.Lock()
	defer srv.Unlock()
	defer fresh.Unlock()
	if fmt.Sprint(fresh.Config.Drives, fresh.Config.NetIfaces, fresh.Config.MachineConfig) != fmt.Sprint(srv.Config.Drives, srv.Config.NetIfaces, srv.Config.MachineConfig) {
		t.Errorf("restored VM differs:\n%v\n%v", fresh.Config, srv.Config)
	}
	if !fresh.Started || fresh.Paused {
		t.Errorf("restored started %v paused %v, want running", fresh.Started, fresh.Paused)
	}
}

// TestStartStopReattach runs the driver against the fake jailer process: the VMM is detached
// and recorded; a "restarted agent" finds it by its record and talks to it; a graceful stop
// ends it; a VMM ignoring Ctrl-Alt-Del is killed after the grace period.
func TestStartStopReattach(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the jail is chowned to the VM's uid")
	}
	self := fakeJailer(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name              string
		ignoreCAD, hangUp bool
	}{{"graceful", false, false}, {"forced", true, false}, {"gone before it answers", false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.ignoreCAD {
				t.Setenv("IMP_FAKE_JAILER_IGNORE_CAD", "1")
			}
			if tc.hangUp {
				// A VMM that exits on Ctrl-Alt-Del before answering it: stopped, not
				// an error (a fake that raced its answer failed CI once).
				t.Setenv("IMP_FAKE_JAILER_CAD_EXIT", "1")
			}
			s := spec(t)
			s.Jailer, s.Firecracker = self, fakeFirecracker
			fakeCgroups(t)
			rec, err := firecracker.Start(ctx, s, "cfg1")
			if err != nil {
				log, _ := os.ReadFile(filepath.Join(s.Dir, "jailer.log"))
				t.Fatalf("%v\n%s", err, log)
			}
			t.Cleanup(func() { _ = syscall.Kill(rec.Pid, syscall.SIGKILL) })

			// A restarted agent: the record, then the API.
			again, err := vmm.ReadRecord(s.Dir)
			if err != nil || *again != *rec || !again.Alive() || again.Kind != "firecracker" {
				t.Fatalf("record %+v, %v; want %+v alive", again, err, rec)
			}
			c := firecracker.NewClient(s.APISocket())
			if info, err := firecracker.Info(ctx, c); err != nil || info.State != "Running" {
				t.Fatalf("re-attached: %+v, %v", info, err)
			}
			// The guest channel over vsock, host-initiated: what imp-init sent so far.
			conn, err := firecracker.DialChannel(s.ChrootDir())
			if err != nil {
				t.Fatal(err)
			}
			var hello, ready guestinit.Message
			dec := json.NewDecoder(conn)
			if err := errors.Join(dec.Decode(&hello), dec.Decode(&ready)); err != nil || hello.Event != "hello" || hello.Token != s.Token || ready.Event != "ready" {
				t.Fatalf("guest channel: %+v %+v %v", hello, ready, err)
			}
			conn.Close()
			// Graceful: over well before a long grace period (its bound only ends a broken
			// run); forced: killed only once a short one has passed.
			grace := 2 * time.Minute
			if tc.ignoreCAD {
				grace = 2 * time.Second
			}
			start := time.Now()
			if err := firecracker.Stop(ctx, c, again, grace); err != nil {
				t.Fatal(err)
			}
			took := time.Since(start)
			if again.Alive() {
				t.Fatal("the VMM still runs after Stop")
			}
			if tc.ignoreCAD != (took >= grace) {
				t.Errorf("stop took %v with a %v grace period (ignoring Ctrl-Alt-Del: %v)", took, grace, tc.ignoreCAD)
			}
		})
	}
}

// TestConfigRemovalStaysInTheJail: a compromised VMM owns its jail's directories and replaces
// /disks with a symlink to a host directory; removing the run's configuration (at the next
// run, or when the run ends) must not remove the host's file of that name.
func TestConfigRemovalStaysInTheJail(t *testing.T) {
	s := spec(t)
	host := t.TempDir()
	victim := filepath.Join(host, "config.img")
	if err := os.WriteFile(victim, []byte("host data"), 0o600); err != nil {
		t.Fatal(err)
	}
	root := s.ChrootDir()
	if err := os.MkdirAll(root, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(host, filepath.Join(root, "disks")); err != nil {
		t.Fatal(err)
	}
	if err := firecracker.RemoveConfig(root); err == nil {
		t.Error("RemoveConfig followed the jail's symlink without an error")
	}
	_ = firecracker.PrepareChroot(s) // refused or not, it must not touch the host
	if b, err := os.ReadFile(victim); err != nil || string(b) != "host data" {
		t.Fatalf("the host's file behind the jail's symlink was removed or changed: %q, %v", b, err)
	}
}

// TestJailLinksAreNotFollowed: a compromised VMM replaces files of its jail with links — its
// writable disk with a symlink to a host file and to the jail's shared base disk, its log with
// a symlink to a host file, its console with a hard link to the host file. Preparing the jail
// again changes neither the host file nor the base disk; the jail holds the VM's own files
// again; capping or reading the planted console refuses it.
func TestJailLinksAreNotFollowed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("chown needs root")
	}
	s := spec(t)
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Fatal(err)
	}
	root := s.ChrootDir()
	victim := filepath.Join(t.TempDir(), "shadow")
	secret := strings.Repeat("host secret\n", 10000)
	if err := os.WriteFile(victim, []byte(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	replace := func(name string, link func(string) error) {
		t.Helper()
		p := filepath.Join(root, name)
		if err := os.Remove(p); err != nil {
			t.Fatal(err)
		}
		if err := link(p); err != nil {
			t.Fatal(err)
		}
	}
	replace("disks/rw.ext4", func(p string) error { return os.Symlink("../disks/base.ext4", p) })
	replace("disks/config.img", func(p string) error { return os.Symlink(victim, p) })
	replace("logs/firecracker.log", func(p string) error { return os.Symlink(victim, p) })
	replace("logs/console.log", func(p string) error { return os.Link(victim, p) })

	if err := vmm.CapFile(root, firecracker.ConsoleFile, 1024); err == nil {
		t.Error("capping a console that is a hard link to a host file did not refuse it")
	}
	if tail := vmm.Tail(root, firecracker.LogFile, 300); tail != "" {
		t.Errorf("the log's tail read through a symlink: %q", tail)
	}
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{victim, s.BaseDisk} {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 {
			t.Errorf("%s now belongs to uid %d", f, st.Uid)
		}
	}
	if b, _ := os.ReadFile(victim); string(b) != secret {
		t.Error("the host file behind the jail's links changed")
	}
	for jail, host := range map[string]string{"disks/rw.ext4": s.WritableDisk, "disks/config.img": s.ConfigDisk, "disks/base.ext4": s.BaseDisk} {
		a, _ := os.Lstat(filepath.Join(root, jail))
		b, _ := os.Stat(host)
		if a == nil || !os.SameFile(a, b) {
			t.Errorf("the jail's %s is not %s again", jail, host)
		}
	}
	for _, f := range []string{"logs/firecracker.log", "logs/console.log"} {
		fi, err := os.Lstat(filepath.Join(root, f))
		if err != nil || !fi.Mode().IsRegular() || fi.Sys().(*syscall.Stat_t).Nlink != 1 || fi.Size() != 0 {
			t.Errorf("the jail's %s was not replaced by a file of its own: %v %v", f, fi, err)
		}
	}
}

// TestRestartsAndResumesInAKeptJail (issue 29): the jail is kept between runs, and the jailer
// mknods its devices at every start, failing on one that exists ("File exists", before the API
// socket appears), as Firecracker fails to bind a vsock socket that exists. Against the
// faithful fake jailer, a VM is started three times in its jail (two restarts), then suspended
// and resumed twice: every start works, the writable disk is the same file (inode) and the
// console log is kept; a suspension's snapshot stays until it is loaded, and goes then.
func TestRestartsAndResumesInAKeptJail(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("the fake jailer chroots, mknods and drops privileges: run as root")
	}
	self := fakeJailer(t)
	cg := fakeCgroups(t)
	ctx := context.Background()
	s := spec(t)
	s.Jailer, s.Firecracker = self, fakeFirecracker
	inode := func(rel string) uint64 {
		fi, err := os.Stat(filepath.Join(s.ChrootDir(), rel))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Sys().(*syscall.Stat_t).Ino
	}
	start := func(what string, f func() (*vmm.Record, error)) *vmm.Record {
		t.Helper()
		rec, err := f()
		if err != nil {
			log, _ := os.ReadFile(filepath.Join(s.Dir, "jailer.log"))
			t.Fatalf("%s: %v\njailer.log:\n%s", what, err, log)
		}
		t.Cleanup(func() { _ = syscall.Kill(rec.Pid, syscall.SIGKILL) })
		if info, err := firecracker.Info(ctx, firecracker.NewJailClient(s.ChrootDir())); err != nil || info.State != "Running" {
			t.Fatalf("%s: %+v, %v", what, info, err)
		}
		return rec
	}
	rec := start("the first start", func() (*vmm.Record, error) { return firecracker.Start(ctx, s, "cfg") })
	// What the real jailer leaves: its devices owned by the VM, its cgroup, the VMM's binary;
	// the VMM runs as the VM's uid.
	for _, d := range []string{"dev/net/tun", "dev/kvm", "dev/urandom"} {
		fi, err := os.Stat(filepath.Join(s.ChrootDir(), d))
		if err != nil || fi.Mode()&os.ModeCharDevice == 0 || fi.Sys().(*syscall.Stat_t).Uid != uint32(s.UID) {
			t.Errorf("the jail's %s: %v, %v", d, fi, err)
		}
	}
	if b, err := os.ReadFile(filepath.Join(cg, "imp", s.ID, "memory.max")); err != nil || string(b) != fmt.Sprint(s.MemoryLimit()) {
		t.Errorf("the VM's cgroup: memory.max %q, %v", b, err)
	}
	status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", rec.Pid))
	if !strings.Contains(string(status), fmt.Sprintf("Uid:\t%d\t%d", s.UID, s.UID)) {
		t.Errorf("the VMM does not run as the VM's uid:\n%s", status)
	}
	disk := inode("disks/rw.ext4")
	console := filepath.Join(s.ChrootDir(), "logs", "console.log")
	if err := os.WriteFile(console, []byte("run 1 said hello\n"), 0o640); err != nil {
		t.Fatal(err)
	}
	stop := func(rec *vmm.Record) {
		t.Helper()
		if err := firecracker.Stop(ctx, firecracker.NewJailClient(s.ChrootDir()), rec, 10*time.Second); err != nil || rec.Alive() {
			t.Fatalf("stopping: %v (alive %v)", err, rec.Alive())
		}
	}
	for i := 2; i <= 3; i++ {
		stop(rec)
		rec = start(fmt.Sprintf("start %d in the kept jail", i), func() (*vmm.Record, error) { return firecracker.Start(ctx, s, "cfg") })
		if inode("disks/rw.ext4") != disk {
			t.Errorf("start %d: the writable disk is another file", i)
		}
		if b, _ := os.ReadFile(console); !strings.Contains(string(b), "run 1 said hello") {
			t.Errorf("start %d: the console log lost the first run's output: %q", i, b)
		}
	}
	for i := 1; i <= 2; i++ {
		if err := firecracker.Suspend(ctx, s, rec); err != nil {
			t.Fatalf("suspend %d: %v", i, err)
		}
		if !firecracker.Snapshotted(s) {
			t.Fatalf("suspend %d: no snapshot", i)
		}
		rec = start(fmt.Sprintf("resume %d", i), func() (*vmm.Record, error) { return firecracker.ResumeSnapshot(ctx, s, "cfg") })
		if firecracker.Snapshotted(s) {
			t.Errorf("resume %d: the snapshot stays after it was loaded", i)
		}
		if inode("disks/rw.ext4") != disk {
			t.Errorf("resume %d: the writable disk is another file", i)
		}
	}
	stop(rec)
}

// TestJailResetStaysInTheJail: before each start the driver removes what the jailer and the VMM
// make in a kept jail (dev/, run/, the copied binary). The jail belongs to the VMM, which may
// have made them links to the host: the reset removes the links, never what they point to.
func TestJailResetStaysInTheJail(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("chown needs root")
	}
	s := spec(t)
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Fatal(err)
	}
	root := s.ChrootDir()
	host := t.TempDir()
	hostFile := filepath.Join(host, "keep")
	// Named as what the reset removes in the jail: a reset that followed the links would take
	// them.
	for _, f := range []string{"keep", "kvm", "urandom", "net/tun", "firecracker.socket", "vsock.sock"} {
		_ = os.MkdirAll(filepath.Dir(filepath.Join(host, f)), 0o700)
		if err := os.WriteFile(filepath.Join(host, f), []byte("host data"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	_ = os.RemoveAll(filepath.Join(root, "run"))
	for name, link := range map[string]func(string) error{
		"dev":                                 func(p string) error { return os.Symlink(host, p) },
		"run":                                 func(p string) error { return os.Symlink(host, p) },
		filepath.Base(s.Firecracker):          func(p string) error { return os.Link(hostFile, p) },
		filepath.Base(s.Firecracker) + ".pid": func(p string) error { return os.Symlink(hostFile, p) },
	} {
		if err := link(filepath.Join(root, name)); err != nil {
			t.Fatal(err)
		}
	}
	if err := firecracker.PrepareChroot(s); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(hostFile); err != nil || string(b) != "host data" {
		t.Errorf("the host's file behind the jail's links: %q, %v", b, err)
	}
	for _, f := range []string{"kvm", "urandom", "net/tun", "firecracker.socket", "vsock.sock"} {
		if _, err := os.Stat(filepath.Join(host, f)); err != nil {
			t.Errorf("the host's %s, behind the jail's links: %v", f, err)
		}
	}
	for _, name := range []string{"dev", filepath.Base(s.Firecracker), filepath.Base(s.Firecracker) + ".pid"} {
		if _, err := os.Lstat(filepath.Join(root, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the jail's %s stays: %v", name, err)
		}
	}
	if fi, err := os.Lstat(filepath.Join(root, "run")); err != nil || !fi.IsDir() {
		t.Errorf("the jail's run/ is not a directory of its own again: %v, %v", fi, err)
	}
}

// TestClaimNodesLeaveTheJail: the node of a drive that is a device (a claim's, here a loop
// device bound to a disk image) is in the jail while Firecracker configures its drives and
// gone once it has it open, before its guest runs: a VMM that closed it could otherwise open it again after the node
// reused the device for another volume. A drive that is a file (an emptyDisk) stays. Without
// anyone holding it, the loop device is free again once the VMM is gone; a resume from a
// suspension loads the node again, and drops it before the guest runs on.
func TestClaimNodesLeaveTheJail(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the jail is chowned to the VM's uid; loop devices")
	}
	self := fakeJailer(t)
	s := spec(t)
	s.Jailer, s.Firecracker = self, fakeFirecracker
	fakeCgroups(t)
	bind := loopClaim(t, &s)
	dev := bind()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(dev.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	scratch := filepath.Join(s.Dir, "vol-scratch.img")
	if err := os.WriteFile(scratch, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	s.Drives = append(s.Drives, vmm.Drive{ID: "scratch", Path: scratch})
	rec, err := firecracker.Start(context.Background(), s, "cfg1")
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(s.Dir, "jailer.log"))
		t.Fatalf("%v\n%s", err, log)
	}
	t.Cleanup(func() { _ = syscall.Kill(rec.Pid, syscall.SIGKILL) })
	dev.Close() // the start is done: the agent lets go of it
	if _, err := os.Lstat(filepath.Join(s.ChrootDir(), "disks/vol-data.img")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the claim's node is still in the jail: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(s.ChrootDir(), "disks/vol-scratch.img")); err != nil {
		t.Errorf("the emptyDisk left the jail: %v", err)
	}
	// Gone before the guest ran: an agent that dies after the start leaves none behind.
	if b, err := os.ReadFile(filepath.Join(s.ChrootDir(), fctest.GuestDisksFile)); err != nil || strings.Contains(string(b), "vol-data.img") || !strings.Contains(string(b), "vol-scratch.img") {
		t.Errorf("the jail's /disks as the guest started: %q, %v; want the emptyDisk and not the claim's node", b, err)
	}
	bound := func() bool {
		_, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
		return err == nil
	}
	if !bound() {
		t.Fatal("the loop device was freed while the VMM runs: the VMM did not hold it open")
	}
	gone := func(what string) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); bound(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the loop device is still bound after %s", what)
			}
		}
	}
	// Suspended (the VMM goes, and the binding with it), then resumed: bound anew as the
	// agent's start does, the node back in the jail for the load, gone before the guest runs.
	if err := firecracker.Suspend(context.Background(), s, rec); err != nil {
		t.Fatal(err)
	}
	gone("the suspend")
	_ = os.Remove(filepath.Join(s.ChrootDir(), fctest.GuestDisksFile))
	dev = bind()
	if err := syscall.Fstat(int(dev.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	if rec, err = firecracker.ResumeSnapshot(context.Background(), s, "cfg1"); err != nil {
		log, _ := os.ReadFile(filepath.Join(s.Dir, "jailer.log"))
		t.Fatalf("resuming: %v\n%s", err, log)
	}
	dev.Close()
	if b, err := os.ReadFile(filepath.Join(s.ChrootDir(), fctest.GuestDisksFile)); err != nil || strings.Contains(string(b), "vol-data.img") || !strings.Contains(string(b), "vol-scratch.img") {
		t.Errorf("the jail's /disks as the resumed guest ran: %q, %v; want the emptyDisk and not the claim's node", b, err)
	}
	if !bound() {
		t.Fatal("the resumed VMM does not hold the loop device")
	}
	_ = syscall.Kill(rec.Pid, syscall.SIGKILL)
	rec.WaitGone(10 * time.Second)
	gone("the VMM went")
}

// TestRestoreAnotherVMsSnapshot: a running VM's snapshot, taken into a directory of the node's,
// restored as another VM in a jail of its own: loaded paused, its claim's node gone from the
// jail, then resumed; its guest answers on its channel.
func TestRestoreAnotherVMsSnapshot(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the jail is chowned to the VM's uid; loop devices")
	}
	self := fakeJailer(t)
	fakeCgroups(t)
	ctx := context.Background()
	src := spec(t)
	src.Jailer, src.Firecracker = self, fakeFirecracker
	dev := loopClaim(t, &src)()
	rec, err := firecracker.Start(ctx, src, "cfg1")
	dev.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Kill(rec.Pid, syscall.SIGKILL) })
	into := t.TempDir()
	if _, err := firecracker.TakeSnapshot(ctx, src, into, nil, nil); err != nil {
		t.Fatal(err)
	}

	copyOf := spec(t)
	copyOf.ID, copyOf.Token = "0b6f3d0e-3c1a-4a8e-9d2b-7f1e2c3d4e5f", "copy"
	copyOf.Jailer, copyOf.Firecracker = self, fakeFirecracker
	copyOf.ChrootBase = src.ChrootBase
	dev = loopClaim(t, &copyOf)()
	rec2, err := firecracker.RestoreSnapshot(ctx, copyOf, filepath.Join(into, firecracker.SnapshotStateFile), filepath.Join(into, firecracker.SnapshotMemFile), "cfg2")
	dev.Close()
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(copyOf.Dir, "jailer.log"))
		t.Fatalf("%v\n%s", err, log)
	}
	t.Cleanup(func() { _ = syscall.Kill(rec2.Pid, syscall.SIGKILL) })
	if info, err := firecracker.Info(ctx, firecracker.NewClient(copyOf.APISocket())); err != nil || info.State != "Running" {
		t.Fatalf("the restored VM: %+v, %v; want Running", info, err)
	}
	if b, err := os.ReadFile(filepath.Join(copyOf.ChrootDir(), fctest.GuestDisksFile)); err != nil || strings.Contains(string(b), "vol-data.img") {
		t.Errorf("the jail's /disks as the restored guest ran: %q, %v; want no claim's node", b, err)
	}
	conn, err := firecracker.DialChannel(copyOf.ChrootDir())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	var hello guestinit.Message
	if err := json.NewDecoder(conn).Decode(&hello); err != nil || hello.Event != "hello" {
		t.Fatalf("the restored guest's channel: %+v, %v", hello, err)
	}
}

// loopClaim gives s the drive "data" of a Filesystem claim as the agent makes it for
// Firecracker: a node in the VM's directory of a loop device bound to a 1 MiB image. It returns
// how to bind it, as each start (and resume) does; the caller closes what that returns once
// the VMM has it.
func loopClaim(t *testing.T, s *firecracker.Spec) (bind func() *os.File) {
	t.Helper()
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	backing, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { backing.Close() })
	node := filepath.Join(s.Dir, "vol-data.img")
	s.Drives = append(s.Drives, vmm.Drive{ID: "data", Path: node})
	return func() *os.File {
		t.Helper()
		dev, err := loop.Devices{}.Attach(node, backing, false)
		if err != nil {
			t.Fatal(err)
		}
		return dev
	}
}
