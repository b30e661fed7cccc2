package qemu

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/syscode-labs/imp/internal/agent/cgroup"
	"github.com/syscode-labs/imp/internal/agent/disk"
	"github.com/syscode-labs/imp/internal/agent/guestmem"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/guestinit"
	"github.com/syscode-labs/imp/internal/testguest"
	"github.com/syscode-labs/imp/internal/testregistry"
)

func TestArgs(t *testing.T) {
	s := Spec{Dir: "/var/lib/imp/vms/u1", Kernel: "/k", Initramfs: "/i", BaseDisk: "/b", WritableDisk: "/w", ConfigDisk: "/c",
		VCPUs: 2, MemoryMiB: 256, Token: "tok", Accel: "tcg", TSCkHz: 2000000, Tap: os.Stdin,
		Net: &guestinit.Net{Address: netip.MustParsePrefix("10.1.0.5/24"), Gateway: netip.MustParseAddr("10.1.0.1"), MTU: 1450, MAC: "0a:58:0a:01:00:05"}}
	args := strings.Join(s.Args(), " ")
	for _, want := range []string{
		"-M microvm -accel tcg,tb-size=64 -cpu max -smp 2 -m 256M",
		"-append console=ttyS0 reboot=t panic=-1 quiet imp.token=tok tsc_early_khz=2000000 tsc=reliable",
		// Every file and socket by descriptor: QEMU opens nothing by a path of the host.
		"-kernel /proc/self/fd/7 -initrd /proc/self/fd/8",
		"id=base,file=/proc/self/fd/9,format=raw,if=none,readonly=on",
		"id=rw,file=/proc/self/fd/10,format=raw,if=none -device virtio-blk-device,drive=rw",
		"id=config,file=/proc/self/fd/11,format=raw,if=none,readonly=on -device virtio-blk-device,drive=config",
		"socket,id=console,fd=14,server=on,wait=off,logfile=/proc/self/fd/12,logappend=on",
		"socket,id=channel,fd=5,server=on,wait=off",
		"socket,id=qmp,fd=6,server=on,wait=off -mon chardev=qmp,mode=control",
		"virtserialport,chardev=channel,name=imp.channel",
		"tsc=reliable imp.net=10.1.0.5/24,10.1.0.1,1450,0a:58:0a:01:00:05 -drive",
		"tap,id=net0,fd=3,vhost=off",
		"virtio-net-device,netdev=net0,mac=0a:58:0a:01:00:05",
		"-no-reboot",
		"-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("args lack %q:\n%s", want, args)
		}
	}
	if strings.Contains(args, "imp.session") {
		t.Errorf("a run without a session channel has its port (its saved devices would not match):\n%s", args)
	}
	s.Session = true
	if args := strings.Join(s.Args(), " "); !strings.Contains(args, "-chardev socket,id=session,fd=13,server=on,wait=off -device virtserialport,chardev=session,name=imp.session") {
		t.Errorf("args lack the session channel:\n%s", args)
	}
	// Disk volumes by descriptor too, after every fixed one, each with its serial.
	// Those that take O_DIRECT bypass the node's page cache.
	s.Drives = []vmm.Drive{{ID: "scratch", Path: "/v1", Serial: "imp-vol0", Direct: true}, {ID: "ro", Path: "/v2", Serial: "imp-vol1", ReadOnly: true, Block: true},
		{ID: "dev", Path: "/v3", Serial: "imp-vol2", Block: true, Direct: true}}
	args = strings.Join(s.Args(), " ")
	for _, want := range []string{
		"-add-fd fd=16,set=10,opaque=vol-scratch -add-fd fd=17,set=10,opaque=vol-scratch-ro -drive id=vol-scratch,file.driver=file,file.filename=/dev/fdset/10,format=raw,if=none,cache.direct=on -device virtio-blk-device,drive=vol-scratch,serial=imp-vol0",
		"-add-fd fd=18,set=11,opaque=vol-ro -add-fd fd=19,set=11,opaque=vol-ro-ro -drive id=vol-ro,file.driver=host_device,file.filename=/dev/fdset/11,format=raw,if=none,readonly=on -device virtio-blk-device,drive=vol-ro,serial=imp-vol1",
		"-drive id=vol-dev,file.driver=host_device,file.filename=/dev/fdset/12,format=raw,if=none,cache.direct=on -device",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("args lack %q:\n%s", want, args)
		}
	}
	s.Drives = nil
	// A resume loads memory and devices from its descriptor; a restore whose memory the agent
	// filled waits for ResumeIncoming to load the devices.
	s.Incoming = "/state"
	if args := strings.Join(s.Args(), " "); !strings.Contains(args, "-incoming fd:4") {
		t.Errorf("a resume's args lack -incoming fd:4:\n%s", args)
	}
	s.MemoryImage = "/memory"
	if args := strings.Join(s.Args(), " "); !strings.Contains(args, "-M microvm,memory-backend=microvm.ram") ||
		!strings.Contains(args, "-object memory-backend-file,id=microvm.ram,size=256M,mem-path=/proc/self/fd/15,share=on -incoming defer") {
		t.Errorf("a restore's args lack its memfd and -incoming defer:\n%s", args)
	}
	// A snapshot's memory that restores share is mapped privately (copy-on-write).
	s.MemoryImage, s.Memory = "", os.Stdin
	if args := strings.Join(s.Args(), " "); !strings.Contains(args, "-M microvm,memory-backend=microvm.ram") ||
		!strings.Contains(args, "-object memory-backend-file,id=microvm.ram,size=256M,mem-path=/proc/self/fd/15,share=off -incoming defer") {
		t.Errorf("a restore's args lack its shared memory, mapped privately, and -incoming defer:\n%s", args)
	}
	s.Incoming, s.Memory = "", nil
	s.Accel, s.Tap, s.Net = "kvm", nil, nil
	args = strings.Join(s.Args(), " ")
	if !strings.Contains(args, "-accel kvm -cpu host") || strings.Contains(args, "tsc_early_khz") || strings.Contains(args, "netdev") {
		t.Errorf("kvm args without a tap:\n%s", args)
	}
}

func TestCapConsole(t *testing.T) {
	dir := t.TempDir()
	var b strings.Builder
	for i := 0; i < 1000; i++ {
		fmt.Fprintf(&b, "line %04d\n", i)
	}
	if err := os.WriteFile(filepath.Join(dir, ConsoleLog), []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CapConsole(dir, 4000); err != nil {
		t.Fatal(err)
	}
	got, _ := os.ReadFile(filepath.Join(dir, ConsoleLog))
	if len(got) > 4000 || !strings.HasSuffix(string(got), "line 0999\n") || strings.Contains(string(got), "line 0000") {
		t.Errorf("capped log (%d bytes) does not end with the newest output:\n%.200s", len(got), got)
	}
	if err := CapConsole(dir, 1<<20); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, ConsoleLog)); string(again) != string(got) {
		t.Error("a log under the cap changed")
	}
}

// TestBootUnderQEMU boots a real guest: an OCI image from a registry on 127.0.0.1 becomes a
// base disk, imp-init mounts it under an overlay on the VM's writable disk, runs the workload,
// reaps its orphan, reports ready and the exit code over the guest channel and powers off.
func TestBootUnderQEMU(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest under QEMU")
	}
	spec := guestSpec(t, guestinit.Config{Argv: []string{"hello", "exit"}, Env: []string{"GREETING=hi"}, WorkingDir: "/home/app", User: "app", Hostname: "vm-one"})
	spec.Token = "t0ken"
	vmDir, rw, base := spec.Dir, spec.WritableDisk, spec.BaseDisk
	name := filepath.Base(vmDir)
	t.Cleanup(func() { cgroup.Remove(cgroup.Root, name) })
	start := time.Now()
	rec, err := Start(spec, "h1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscallKill(rec.Pid) })
	if got, err := vmm.ReadRecord(vmDir); err != nil || *got != *rec || !got.Alive() {
		t.Fatalf("record %+v, %v; want %+v alive", got, err, rec)
	}
	lines, _ := cgroup.Of(rec.Pid)
	for _, l := range lines {
		if !strings.HasSuffix(l, "/"+cgroup.Parent+"/"+name) {
			t.Errorf("the VMM is not in a cgroup of its own in every hierarchy: %v", lines)
			break
		}
	}
	confined(t, rec.Pid, name, spec.Limits())

	// The guest channel: hello with the token, ready, the exit code.
	var conn net.Conn
	deadline := time.Now().Add(30 * time.Second)
	for conn == nil {
		conn, err = DialChannel(vmDir)
		if err != nil && time.Now().After(deadline) {
			t.Fatalf("dialing the guest channel: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(90 * time.Second))
	var events []string
	var readyAt time.Duration
	exit := -1
	sc := bufio.NewScanner(conn)
	for exit < 0 && sc.Scan() {
		var m guestinit.Message
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("bad channel line %q: %v", sc.Text(), err)
		}
		events = append(events, m.Event)
		switch m.Event {
		case "hello":
			if m.Token != "t0ken" {
				t.Errorf("hello with token %q", m.Token)
			}
		case "ready":
			readyAt = time.Since(start)
		case "exit":
			exit = *m.Code
		case "error":
			t.Errorf("guest error: %s", m.Message)
		}
	}
	console, _ := os.ReadFile(filepath.Join(vmDir, ConsoleLog))
	if exit != 3 {
		qlog, _ := os.ReadFile(filepath.Join(vmDir, qemuLog))
		t.Fatalf("exit code %d (events %v, scan error %v); console:\n%s\nqemu:\n%s", exit, events, sc.Err(), console, qlog)
	}
	t.Logf("launch→ready %v under %s; events %v", readyAt.Round(time.Millisecond), spec.Accel, events)

	// The VMM exits with the guest.
	for rec.Alive() {
		if time.Since(start) > 4*time.Minute {
			t.Fatal("QEMU still runs after the guest powered off")
		}
		time.Sleep(50 * time.Millisecond)
	}
	console, _ = os.ReadFile(filepath.Join(vmDir, ConsoleLog))
	for _, want := range []string{"hello from imp: GREETING=hi host=vm-one", "uid=1000 wd=/home/app", "workload exited with code 3"} {
		if !strings.Contains(string(console), want) {
			t.Errorf("console lacks %q:\n%s", want, console)
		}
	}
	if strings.Contains(string(console), "freezing the writable disk") {
		t.Errorf("imp-init could not freeze the writable disk before powering off:\n%s", console)
	}
	// The guest wrote to its overlay's upper layer, on its own disk; the base disk is untouched.
	if out, err := exec.Command("debugfs", "-R", "cat /upper/home/app/written-by-guest", rw).CombinedOutput(); err != nil || !strings.Contains(string(out), "upper layer of vm-one") {
		t.Errorf("the guest's write is not on its writable disk: %v\n%s", err, out)
	}
	if out, _ := exec.Command("debugfs", "-R", "stat /home/app/written-by-guest", base).CombinedOutput(); !strings.Contains(string(out), "File not found") {
		t.Errorf("the guest's write reached the shared base disk:\n%s", out)
	}
}

// TestQMPQuit: the VMM answers QMP (status running) and exits on quit, whatever the guest is
// doing (here: still booting, its disks blank).
func TestQMPQuit(t *testing.T) {
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	for _, f := range []string{"base", "rw", "config"} {
		if err := os.WriteFile(filepath.Join(tmp, f), make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	spec := Spec{Dir: tmp, Kernel: kernel, Initramfs: initrd, BaseDisk: filepath.Join(tmp, "base"), WritableDisk: filepath.Join(tmp, "rw"), ConfigDisk: filepath.Join(tmp, "config"),
		VCPUs: 1, MemoryMiB: 128, Token: "t", Accel: "tcg", TSCkHz: TSCkHz()}
	rec, err := Start(spec, "h")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscallKill(rec.Pid) })
	var q *QMP
	for deadline := time.Now().Add(20 * time.Second); q == nil; {
		if q, err = DialQMP(tmp, 2*time.Second); err != nil && time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	st, err := q.Execute("query-status", nil)
	if err != nil || !strings.Contains(string(st), `"running"`) {
		t.Fatalf("query-status = %s, %v", st, err)
	}
	if _, err := q.Execute("no-such-command", nil); err == nil || !strings.Contains(err.Error(), "CommandNotFound") {
		t.Errorf("an unknown command: %v, want CommandNotFound", err)
	}
	q.Close()
	if err := Quit(tmp); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); rec.Alive(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("QEMU still runs after QMP quit")
		}
	}
}

// TestSuspendResume: a guest counting ticks is suspended to a file (its VMM gone) and resumed
// from it; the count goes on from where it was, the workload not started again.
func TestSuspendResume(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a guest under QEMU")
	}
	spec := guestSpec(t, guestinit.Config{Argv: []string{"/bin/hello", "serve"}, Hostname: "counter"})
	vmDir := spec.Dir
	rec, err := Start(spec, "h")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscallKill(rec.Pid) })
	// The agent's end of the guest channel, as the agent keeps it: imp-init's messages wait for
	// a reader.
	drainChannel(t, vmDir)
	console := func() string { b, _ := os.ReadFile(filepath.Join(vmDir, ConsoleLog)); return string(b) }
	waitFor := func(what string, d time.Duration, f func() bool) {
		t.Helper()
		for deadline := time.Now().Add(d); !f(); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s; console:\n%s", what, console())
			}
		}
	}
	waitFor("no tick 3", 4*time.Minute, func() bool { return hasLine(console(), "hello: tick 3") })

	start := time.Now()
	if err := Suspend(vmDir, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitFor("the VMM runs after suspend", 10*time.Second, func() bool { return !rec.Alive() })
	t.Logf("suspend (256 MiB guest, TCG): %v", time.Since(start).Round(time.Millisecond))
	before := console()
	last := strings.Count(before, "hello: tick ")
	time.Sleep(2 * time.Second)
	if console() != before {
		t.Error("the console grew while the VM was suspended")
	}

	spec.Incoming = filepath.Join(vmDir, StateFile)
	start = time.Now()
	rec, err = Start(spec, "h")
	if err != nil {
		t.Fatal(err)
	}
	if err := ResumeIncoming(vmDir, rec, time.Minute); err != nil {
		t.Fatal(err)
	}
	t.Logf("resume: %v", time.Since(start).Round(time.Millisecond))
	confined(t, rec.Pid, filepath.Base(vmDir), spec.Limits()) // resumed from a descriptor, spawning nothing
	waitFor("no tick after resume", 30*time.Second, func() bool { return strings.Count(console(), "hello: tick ") > last+1 })
	after := console()[len(before):]
	if strings.Contains(after, "hello from imp") || hasLine(after, "hello: tick 0") {
		t.Errorf("the workload started again instead of continuing:\n%s", after)
	}
	t.Logf("after resume:\n%s", after)

	// A snapshot, its memory split out of the stream into a file of its own (guestmem), and a
	// restore that fills a new memfd with it: the count goes on from the snapshot's, the
	// workload not started again.
	snapDir := t.TempDir()
	stream, devices, memFile := filepath.Join(snapDir, "stream"), filepath.Join(snapDir, "state"), filepath.Join(snapDir, "memory")
	state, err := os.Create(stream)
	if err != nil {
		t.Fatal(err)
	}
	pause, err := Snapshot(vmDir, state, nil, time.Minute)
	state.Close()
	if err != nil {
		t.Fatal(err)
	}
	if err := guestmem.Split(stream, devices, memFile, RAMID, spec.MemoryMiB<<20); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(devices)
	t.Logf("snapshot: paused %v, devices %d bytes", pause.Round(time.Millisecond), fi.Size())
	if fi.Size() > 4<<20 {
		t.Errorf("the devices' state is %d bytes: the memory is in the stream", fi.Size())
	}
	atSnapshot := strings.Count(console(), "hello: tick ")
	if err := Quit(vmDir); err != nil {
		t.Fatal(err)
	}
	waitFor("the VMM runs after quit", 10*time.Second, func() bool { return !rec.Alive() })
	// restore starts the VM on the snapshot's devices and spec's memory, and waits for the
	// count to go on from the snapshot's, the workload not started again.
	restore := func(how string) {
		t.Helper()
		before := console()
		start := time.Now()
		if rec, err = Start(spec, "h"); err != nil {
			t.Fatal(err)
		}
		if rec.IncomingFD == 0 {
			t.Errorf("the record of a restore %s has no IncomingFD", how)
		}
		if err := ResumeIncoming(vmDir, rec, time.Minute); err != nil {
			t.Fatal(err)
		}
		t.Logf("restore %s: %v", how, time.Since(start).Round(time.Millisecond))
		waitFor("no tick after the restore "+how, 30*time.Second, func() bool { return strings.Count(console(), "hello: tick ") > atSnapshot+1 })
		if after := console()[len(before):]; strings.Contains(after, "hello from imp") || hasLine(after, "hello: tick 0") {
			t.Errorf("the workload started again instead of continuing after the restore %s:\n%s", how, after)
		}
	}
	spec.Incoming, spec.MemoryImage = devices, memFile
	restore("with the memory mapped back")

	// Restored again, from the snapshot's memory as the node's cache keeps it for every
	// restore (guestmem.Cache): mapped privately, the count goes on, and what the guest wrote
	// is its own (the cached memory is the snapshot's still).
	atSnapshot = strings.Count(console(), "hello: tick ")
	if err := Quit(vmDir); err != nil {
		t.Fatal(err)
	}
	waitFor("the VMM runs after quit", 10*time.Second, func() bool { return !rec.Alive() })
	set, err := cgroup.Prepare(cgroup.Root, "test-qemu-memories", cgroup.Limits{MemoryBytes: 1 << 30, Pids: 16})
	if err != nil {
		t.Fatalf("no cgroups here (the restore of a VM needs them too): %v", err)
	}
	t.Cleanup(func() { cgroup.Remove(cgroup.Root, "test-qemu-memories") })
	cache := guestmem.NewCache(1<<30, memCharge{set})
	defer cache.Close()
	<-cache.Warm(memFile, spec.MemoryMiB<<20)
	shared, err := cache.Get(memFile, spec.MemoryMiB<<20, "vm")
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	spec.Incoming, spec.MemoryImage, spec.Memory = devices, "", shared
	restore("on the shared memory")
	want, _ := os.ReadFile(memFile)
	got := make([]byte, len(want))
	if _, err := shared.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Errorf("the shared memory is not the snapshot's once a guest ran on it (%v)", err)
	}
	spec.Memory = nil

	// The restored VM suspends with its memory in the stream again (x-ignore-shared off).
	if err := Suspend(vmDir, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitFor("the VMM runs after suspend", 10*time.Second, func() bool { return !rec.Alive() })
	if fi, err := os.Stat(filepath.Join(vmDir, StateFile)); err != nil || fi.Size() < 16<<20 {
		t.Fatalf("the restored VM's suspend saved %v bytes (%v): not its memory", fi, err)
	}
	last = strings.Count(console(), "hello: tick ")
	spec.Incoming, spec.MemoryImage = filepath.Join(vmDir, StateFile), ""
	if rec, err = Start(spec, "h"); err != nil {
		t.Fatal(err)
	}
	if err := ResumeIncoming(vmDir, rec, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitFor("no tick after the second resume", 30*time.Second, func() bool { return strings.Count(console(), "hello: tick ") > last+1 })
}

// TestDupFileIsCloseOnExec: the descriptors the agent duplicates for a VMM (a restored guest's
// memory, a volume) are close-on-exec from the start, so that another VMM started at that
// instant does not inherit them.
func TestDupFileIsCloseOnExec(t *testing.T) {
	f, err := os.Open("/dev/null")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d, err := dupFile(f)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	flags, err := unix.FcntlInt(d.Fd(), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC == 0 {
		t.Errorf("the duplicate's flags %#x (%v): not close-on-exec", flags, err)
	}
}

// memCharge is a cgroup of the test's, as the agent's cache of snapshots' memory has one.
type memCharge struct{ set *cgroup.Set }

func (c memCharge) Join(pid int) error {
	_, err := c.set.Join(pid, false)
	return err
}

func (c memCharge) Shmem() (int64, error) { return c.set.MemoryStat("shmem") }

// TestMain: a restore fills the guest's memory in a child that is this binary again.
func TestMain(m *testing.M) {
	guestmem.Init()
	os.Exit(m.Run())
}

// hasLine says whether text has line (the serial console ends lines with \r\n).
func hasLine(text, line string) bool {
	for _, l := range strings.Split(text, "\n") {
		if strings.TrimRight(l, "\r") == line {
			return true
		}
	}
	return false
}

// guestSpec is a 256 MiB, one-vCPU guest under TCG (issue 4: proven under TCG) of the test
// image from a registry on 127.0.0.1, with its base disk and a writable disk holding cfg.
func guestSpec(t *testing.T, cfg guestinit.Config) Spec {
	t.Helper()
	tmp := t.TempDir()
	kernel, initrd := testguest.Artifacts(t, tmp)
	ref := testguest.Image(t, testregistry.Start(t, "", ""), "hello")
	store := &disk.BaseStore{Dir: filepath.Join(tmp, "images"), MaxBytes: 1 << 30}
	base, _, err := store.Ensure(context.Background(), "team", ref, disk.PullSecretKeychain{})
	if err != nil {
		t.Fatal(err)
	}
	vmDir := filepath.Join(tmp, "vm")
	if err := os.Mkdir(vmDir, 0o700); err != nil {
		t.Fatal(err)
	}
	rw := filepath.Join(vmDir, "rw.ext4")
	if err := (&disk.Writables{Dir: filepath.Join(filepath.Dir(rw), "templates"), Spares: -1}).Ensure(rw, 64<<20); err != nil {
		t.Fatal(err)
	}
	config := filepath.Join(vmDir, "config.img")
	if err := disk.WriteConfig(config, cfg); err != nil {
		t.Fatal(err)
	}
	return Spec{Dir: vmDir, Kernel: kernel, Initramfs: initrd, BaseDisk: base, WritableDisk: rw, ConfigDisk: config,
		VCPUs: 1, MemoryMiB: 256, Token: "t", Accel: "tcg", TSCkHz: TSCkHz(), CgroupRoot: cgroup.Root,
		UID: guestUID, GID: guestUID}
}

// guestUID is the uid test guests' QEMU runs as: one of no account, as a VM's jail uid is.
const guestUID = 399_977

// confined asserts that QEMU (pid) runs under its seccomp sandbox and in cgroups that bound its
// memory and threads as lim says, whichever cgroup version the host has.
func confined(t *testing.T, pid int, name string, lim cgroup.Limits) {
	t.Helper()
	// QEMU installs its filter once its options are parsed, a moment after it starts.
	var status []byte
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		var err error
		if status, err = os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(status), "\nSeccomp:\t2\n") {
			break
		}
	}
	if !strings.Contains(string(status), "\nSeccomp:\t2\n") {
		t.Errorf("QEMU runs without a seccomp filter:\n%s", status)
	}
	uid := fmt.Sprintf("\nUid:\t%d\t%d\t%d\t%d\n", guestUID, guestUID, guestUID, guestUID)
	if !strings.Contains(string(status), uid) || !strings.Contains(string(status), "\nCapEff:\t0000000000000000\n") {
		t.Errorf("QEMU does not run as uid %d without capabilities:\n%s", guestUID, status)
	}
	read := func(paths ...string) string {
		for _, p := range paths {
			if b, err := os.ReadFile(filepath.Join(cgroup.Root, p)); err == nil {
				return strings.TrimSpace(string(b))
			}
		}
		return ""
	}
	if got := read(filepath.Join("memory", cgroup.Parent, name, "memory.limit_in_bytes"), filepath.Join(cgroup.Parent, name, "memory.max")); got != fmt.Sprint(lim.MemoryBytes) {
		t.Errorf("memory limit %q, want %d", got, lim.MemoryBytes)
	}
	if got := read(filepath.Join("pids", cgroup.Parent, name, "pids.max"), filepath.Join(cgroup.Parent, name, "pids.max")); got != fmt.Sprint(lim.Pids) {
		t.Errorf("pids limit %q, want %d", got, lim.Pids)
	}
}

// A volume goes direct where its file takes O_DIRECT, opened as the drive would be (never
// through a link), or its open descriptor does, reopened without changing the caller's.
func TestDirect(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(file, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if f, err := os.OpenFile(file, os.O_RDONLY|unix.O_DIRECT, 0); err != nil {
		t.Skipf("this file system takes no O_DIRECT: %v", err)
	} else {
		f.Close()
	}
	if err := os.Symlink(file, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	open, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	got := direct([]vmm.Drive{{ID: "path", Path: file}, {ID: "link", Path: filepath.Join(dir, "link")}, {ID: "fd", File: open}, {ID: "missing", Path: filepath.Join(dir, "none")}})
	for i, want := range []bool{true, false, true, false} {
		if got[i].Direct != want {
			t.Errorf("drive %s: Direct %v, want %v", got[i].ID, got[i].Direct, want)
		}
	}
	if fl, err := unix.FcntlInt(open.Fd(), unix.F_GETFL, 0); err != nil || fl&unix.O_DIRECT != 0 {
		t.Errorf("the caller's descriptor's flags %#x (%v): O_DIRECT set on it", fl, err)
	}
}
