package volume

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/vmrun"
	"github.com/syscode-labs/imp/internal/guestinit"
)

// fakeHolder lays out a /proc with the holder pod's pause process (its root without the
// holder's directories) and its container's process, whose root is a directory of the test
// (a plain link standing for /proc/PID/root), for pod uid.
func fakeHolder(t *testing.T, uid string) (proc, root string) {
	t.Helper()
	tmp := t.TempDir()
	proc, root = filepath.Join(tmp, "proc"), filepath.Join(tmp, "root")
	pause := filepath.Join(tmp, "pause")
	for pid, r := range map[string]string{"100": pause, "200": root} {
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/cid"+pid+"abcdef\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(r, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(r, filepath.Join(proc, pid, "root")); err != nil {
			t.Fatal(err)
		}
	}
	// Another pod's process, whose root holds a claim of the same volume name.
	other := filepath.Join(tmp, "other")
	if err := os.MkdirAll(filepath.Join(proc, "300"), 0o755); err != nil {
		t.Fatal(err)
	}
	_ = os.WriteFile(filepath.Join(proc, "300", "cgroup"), []byte("0::/kubepods/besteffort/podOTHER/c\n"), 0o644)
	_ = os.MkdirAll(filepath.Join(other, "imp/volumes/data"), 0o755)
	_ = os.Symlink(other, filepath.Join(proc, "300", "root"))
	// An ephemeral container of the holder pod (pid 150, before the holder's in /proc), whose
	// root holds a disk.img of its own making.
	eph := filepath.Join(tmp, "ephemeral")
	_ = os.MkdirAll(filepath.Join(proc, "150"), 0o755)
	_ = os.WriteFile(filepath.Join(proc, "150", "cgroup"), []byte("0::/kubepods/besteffort/pod"+uid+"/cidEPHEMERAL\n"), 0o644)
	_ = os.MkdirAll(filepath.Join(eph, "imp/volumes/data"), 0o755)
	_ = os.WriteFile(filepath.Join(eph, "imp/volumes/data/disk.img"), []byte("planted"), 0o600)
	_ = os.Symlink(eph, filepath.Join(proc, "150", "root"))
	if err := os.MkdirAll(filepath.Join(root, "imp/volumes/data"), 0o755); err != nil {
		t.Fatal(err)
	}
	return proc, root
}

// TestClaimDisk opens a Filesystem claim's disk image in the holder pod's container: made at the
// claim's size with an ext4 file system the first time, the same file after. What the tenant
// put on the claim never points the node elsewhere: a disk.img that is a link (to a host file),
// a claim directory that is a link (to the host's /), a device that is a link or a regular file.
func TestClaimDisk(t *testing.T) {
	proc, root := fakeHolder(t, "u-1")
	m := Maker{Proc: proc}
	h := &impv1.VolumeHolderStatus{PodUID: "u-1", ContainerID: "containerd://cid200abcdef"}
	c := impv1.HeldClaim{Volume: "data", SizeBytes: 64 << 20}
	f, _, err := m.claimDisk(h, c, false, true)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	img := filepath.Join(root, "imp/volumes/data/disk.img")
	fi, err := os.Stat(img)
	if err != nil || fi.Size() != 64<<20 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("disk.img: %v %v", fi, err)
	}
	label := make([]byte, 16)
	g, _ := os.Open(img)
	_, _ = g.ReadAt(label, 1024+0x78)
	g.Close()
	if string(bytes.TrimRight(label, "\x00")) != guestinit.VolumeLabel {
		t.Errorf("disk.img's file system label %q", label)
	}
	if err := os.WriteFile(img, []byte("kept"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, _, err = m.claimDisk(h, c, false, true)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	_, _ = f.ReadAt(b, 0)
	f.Close()
	if string(b) != "kept" {
		t.Errorf("the second open made the image anew: %q", b)
	}

	secret := filepath.Join(t.TempDir(), "host-secret")
	if err := os.WriteFile(secret, []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	attacks := map[string]func(){
		"disk.img a link to a host file": func() {
			_ = os.Remove(img)
			_ = os.Symlink(secret, img)
		},
		"the claim's directory a link to /": func() {
			_ = os.RemoveAll(filepath.Join(root, "imp/volumes/data"))
			_ = os.Symlink("/", filepath.Join(root, "imp/volumes/data"))
		},
		"disk.img a directory": func() {
			_ = os.RemoveAll(filepath.Join(root, "imp/volumes/data"))
			_ = os.MkdirAll(img, 0o755)
		},
	}
	for name, plant := range attacks {
		_ = os.RemoveAll(filepath.Join(root, "imp/volumes/data"))
		_ = os.MkdirAll(filepath.Join(root, "imp/volumes/data"), 0o755)
		plant()
		if f, _, err := m.claimDisk(h, c, false, false); err == nil {
			f.Close()
			t.Errorf("%s: opened", name)
		}
		if b, _ := os.ReadFile(secret); string(b) != "host" {
			t.Fatalf("%s: the host file changed: %q", name, b)
		}
	}
	// A FIFO at disk.img of a read-only claim: opened, it would block the agent for ever.
	_ = os.RemoveAll(filepath.Join(root, "imp/volumes/data"))
	_ = os.MkdirAll(filepath.Join(root, "imp/volumes/data"), 0o755)
	if err := unix.Mkfifo(img, 0o600); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		f, _, err := m.claimDisk(h, c, true, false)
		if err == nil {
			f.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Errorf("a FIFO at disk.img: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a FIFO at disk.img blocked the open")
	}
	// A Block claim's device must be a block device, reached without a link.
	_ = os.MkdirAll(filepath.Join(root, "dev/imp"), 0o755)
	blk := impv1.HeldClaim{Volume: "raw", Block: true}
	_ = os.Symlink("/dev/null", filepath.Join(root, "dev/imp/raw"))
	if f, _, err := m.claimDisk(h, blk, false, false); err == nil {
		f.Close()
		t.Error("a link at the device's place was opened")
	}
	_ = os.Remove(filepath.Join(root, "dev/imp/raw"))
	_ = os.WriteFile(filepath.Join(root, "dev/imp/raw"), nil, 0o600)
	if _, _, err := m.claimDisk(h, blk, false, false); err == nil || !strings.Contains(err.Error(), "not a block device") {
		t.Errorf("a regular file at the device's place: %v", err)
	}
	// Another pod's claims are not this one's.
	if _, _, err := m.claimDisk(&impv1.VolumeHolderStatus{PodUID: "u-2", ContainerID: "containerd://cid200abcdef"}, c, false, false); err == nil || !strings.Contains(err.Error(), "no process of the holder pod u-2") {
		t.Errorf("a pod with no process here: %v", err)
	}
}

// TestReadOnlyClaims: a claim the node holds read-only is opened read-only and reported so,
// whatever the VM asked: a Filesystem claim the kubelet mounted read-only (a read-only bind of
// its directory), and a Block claim's device the kernel marks read-only (a read-only loop
// device). A writable device is writable. Root: mounts and loop devices.
func TestReadOnlyClaims(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: a read-only bind mount and a loop device")
	}
	proc, root := fakeHolder(t, "u-1")
	m := Maker{Proc: proc}
	h := &impv1.VolumeHolderStatus{PodUID: "u-1", ContainerID: "containerd://cid200abcdef"}
	dir := filepath.Join(root, "imp/volumes/data")
	if err := os.WriteFile(filepath.Join(dir, "disk.img"), make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	f, ro, err := m.claimDisk(h, impv1.HeldClaim{Volume: "data", SizeBytes: 1 << 20}, false, true)
	if err != nil || !ro {
		t.Fatalf("a read-only mounted claim: ro %v, %v", ro, err)
	}
	f.Close()

	// A loop device, read-only and then read-write, at the holder's device path.
	backing := filepath.Join(t.TempDir(), "blk.img")
	if err := os.WriteFile(backing, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "dev/imp"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, kernelRO := range []bool{true, false} {
		args := []string{"--find", "--show"}
		if kernelRO {
			args = append(args, "--read-only")
		}
		out, err := exec.Command("losetup", append(args, backing)...).CombinedOutput()
		if err != nil {
			t.Fatalf("losetup: %v: %s", err, out)
		}
		loop := strings.TrimSpace(string(out))
		t.Cleanup(func() { _ = exec.Command("losetup", "-d", loop).Run() })
		var st unix.Stat_t
		if err := unix.Stat(loop, &st); err != nil {
			t.Fatal(err)
		}
		node := filepath.Join(root, "dev/imp/raw")
		_ = os.Remove(node)
		if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(st.Rdev)); err != nil {
			t.Fatal(err)
		}
		f, ro, err := m.claimDisk(h, impv1.HeldClaim{Volume: "raw", Block: true}, false, false)
		if err != nil || ro != kernelRO {
			t.Fatalf("a loop device read-only=%v: ro %v, %v", kernelRO, ro, err)
		}
		f.Close()
	}
}

// TestFilesystemClaimUnderFirecracker: Firecracker opens its drives by path in its jail, where
// the claim's file system is not. The drive of a Filesystem claim is a node, in the VM's state
// directory, of a loop device bound to the claim's disk.img: a write through it lands in the
// image. The binding outlives the start while the VMM holds the device, and ends when it
// closes it; a start the VMM never opened it in leaves nothing bound.
func TestFilesystemClaimUnderFirecracker(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: loop devices")
	}
	proc, root := fakeHolder(t, "u-1")
	m := Maker{Proc: proc, ChooseVMM: func(*impv1.ImpVM) (impv1.VMMKind, error) { return impv1.VMMFirecracker, nil }}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "db", UID: "u1"}}
	vm.Spec.Volumes = []impv1.Volume{{Name: "data", PersistentVolumeClaim: &impv1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}
	vm.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "data", MountPath: "/data"}}
	vm.Status.NodeName = "n1"
	vm.Status.VolumeHolder = &impv1.VolumeHolderStatus{PodUID: "u-1", ContainerID: "containerd://cid200abcdef", Ready: true, NodeName: "n1",
		Claims: []impv1.HeldClaim{{Volume: "data", SizeBytes: 16 << 20}}}
	dir := t.TempDir()
	bound := func(path string) string {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(path, &st); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(st.Rdev), unix.Minor(st.Rdev)))
		return strings.TrimSpace(string(b))
	}
	unbound := func(path string) bool {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if bound(path) == "" {
				return true
			}
		}
		return false
	}
	img := filepath.Join(root, "imp/volumes/data/disk.img")

	r := &vmrun.Run{VM: vm, Dir: dir, Image: &vmrun.Image{}}
	v, err := m.Make(r)
	if err != nil {
		t.Fatal(err)
	}
	d := v.Drives[0]
	if d.File != nil || d.Path != filepath.Join(dir, DiskFile("data")) || d.Serial == "" || v.Guest.Volumes[0].Serial != d.Serial {
		t.Fatalf("drive %+v, guest volume %+v", d, v.Guest.Volumes[0])
	}
	if got := bound(d.Path); got != img {
		t.Fatalf("the drive's device is bound to %q; want %s", got, img)
	}
	vmm, err := os.OpenFile(d.Path, os.O_RDWR, 0) // as Firecracker does when its drives are configured
	if err != nil {
		t.Fatal(err)
	}
	r.Done()
	if _, err := vmm.WriteAt([]byte("from the VMM"), 8<<20); err != nil {
		t.Fatal(err)
	}
	if err := vmm.Sync(); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 12)
	if g, err := os.Open(img); err == nil {
		_, _ = g.ReadAt(b, 8<<20)
		g.Close()
	}
	if string(b) != "from the VMM" {
		t.Errorf("the write through the device is not in disk.img: %q", b)
	}
	vmm.Close()
	if !unbound(d.Path) {
		t.Error("still bound after the VMM closed it")
	}

	// A start that fails before the VMM opened it.
	r = &vmrun.Run{VM: vm, Dir: dir, Image: &vmrun.Image{}}
	if _, err := m.Make(r); err != nil {
		t.Fatal(err)
	}
	r.Done()
	if !unbound(filepath.Join(dir, DiskFile("data"))) {
		t.Error("still bound after a start that never reached the VMM")
	}
}
