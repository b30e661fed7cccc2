package agent_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmm"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker"
	"github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest"
	"github.com/syscode-labs/imp/internal/agent/volume"
)

// TestFirecrackerVM runs a VM that asks for Firecracker on a node offering it, with a fake
// jailer standing in for the jailer and Firecracker (this machine has no usable KVM; see
// fctest.FakeJailer): the agent builds the jail, launches the jailer with the VM's uid and
// limits, configures the VM over the API (the strict double), follows the guest channel over
// vsock to Ready, and on deletion stops the VMM and removes the jail.
func TestFirecrackerVM(t *testing.T) {
	jailer, firecrackerBin := fakeJailer(t)
	w := newWorld(t, func(o *agent.Options) {
		o.VMMs = []impv1.VMMKind{impv1.VMMFirecracker, impv1.VMMQEMU}
		o.Firecracker, o.Jailer = firecrackerBin, jailer
	})
	ctx := context.Background()
	g := NewWithT(t)
	// The node's report offers firecracker first.
	g.Eventually(func() string {
		var n impv1.ImpNode
		if err := w.c.Client.Get(ctx, types.NamespacedName{Name: w.node}, &n); err != nil || len(n.Status.VMMs) == 0 {
			return ""
		}
		return string(n.Status.VMMs[0].Kind)
	}).WithTimeout(30 * time.Second).Should(Equal("firecracker"))

	vm := w.vm("fc", "serve")
	vm.Spec.VMM = impv1.VMMFirecracker
	vm.Spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("fc")
		return v != nil && v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(6*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), func() string { return fmt.Sprintf("%+v", w.get("fc").Status) })

	v := w.get("fc")
	dir := filepath.Join(w.stateDir, "vms", string(v.UID))
	rec, err := vmm.ReadRecord(dir)
	if err != nil || rec.Kind != "firecracker" || !rec.Alive() {
		t.Fatalf("record %+v, %v", rec, err)
	}
	var m struct {
		VMM     string `json:"vmm"`
		JailUID int    `json:"jailUID"`
	}
	data, _ := os.ReadFile(filepath.Join(dir, "meta.json"))
	_ = json.Unmarshal(data, &m)
	if m.VMM != "firecracker" || m.JailUID != 300000 {
		t.Errorf("meta %s", data)
	}
	// The jailer exec'd the VMM (the recorded pid) in the jail, as the VM's uid, in the VM's
	// cgroup, with the jailer's arguments.
	jail := filepath.Join(w.stateDir, "jail", "firecracker", string(v.UID))
	proc := "/proc/" + strconv.Itoa(rec.Pid)
	cmdline, _ := os.ReadFile(proc + "/cmdline")
	args := strings.ReplaceAll(string(cmdline), "\x00", " ")
	if !strings.HasPrefix(args, "/firecracker --id="+string(v.UID)+" --start-time-us=") || !strings.HasSuffix(args, " --api-sock /run/firecracker.socket ") {
		t.Errorf("the VMM's command line: %s", args)
	}
	if root, err := os.Readlink(proc + "/root"); err != nil || root != filepath.Join(jail, "root") {
		t.Errorf("the VMM's root is %q, %v; want its jail", root, err)
	}
	status, _ := os.ReadFile(proc + "/status")
	if !strings.Contains(string(status), "Uid:\t300000\t300000") || !strings.Contains(string(status), "Gid:\t300000\t300000") {
		t.Errorf("the VMM does not run as the VM's uid and gid:\n%s", status)
	}
	if cg, _ := os.ReadFile(proc + "/cgroup"); !strings.Contains(string(cg), "/imp/"+string(v.UID)) {
		t.Errorf("the VMM is not in the VM's cgroup:\n%s", cg)
	}

	// The serial console's input: Firecracker's stdin, the FIFO of the VM's directory (the
	// fake's guest answers each line on the console it writes).
	in, _, err := w.agent.Runs.ConsoleInput(types.NamespacedName{Namespace: v.Namespace, Name: v.Name}, v.UID)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Write([]byte("ping\r\n")); err != nil {
		t.Fatalf("typing into the console: %v", err)
	}
	in.Close()
	g.Eventually(func() string {
		b, _ := os.ReadFile(filepath.Join(jail, "root", "logs", "console.log"))
		return string(b)
	}).WithTimeout(30*time.Second).Should(ContainSubstring(`console said "ping"`), "the console's input reached the VMM's stdin")

	st, err := os.Stat(filepath.Join(jail, "root", "disks", "rw.ext4"))
	if err != nil || st.Sys().(*syscall.Stat_t).Uid != 300000 {
		t.Errorf("the VM's disk in the jail: %v", err)
	}
	disk := st.Sys().(*syscall.Stat_t).Ino
	ready := func() bool {
		v := w.get("fc")
		return v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}
	// The jail is kept between runs: what the jailer makes at each start (its devices) must
	// not be there, or it exits with "File exists" (issue 29). Each run is a new VMM in the same
	// jail, on the same writable disk, with the console kept.
	kept := func(what string, prev *vmm.Record) *vmm.Record {
		t.Helper()
		next, err := vmm.ReadRecord(dir)
		if err != nil || !next.Alive() || next.Pid == prev.Pid {
			t.Fatalf("%s: record %+v, %v (was pid %d)", what, next, err, prev.Pid)
		}
		if prev.Alive() {
			t.Errorf("%s: the previous VMM runs on", what)
		}
		if st, err := os.Stat(filepath.Join(jail, "root", "disks", "rw.ext4")); err != nil || st.Sys().(*syscall.Stat_t).Ino != disk {
			t.Errorf("%s: the writable disk is another file (%v)", what, err)
		}
		if b, _ := os.ReadFile(filepath.Join(jail, "root", "logs", "console.log")); !strings.Contains(string(b), `console said "ping"`) {
			t.Errorf("%s: the console lost the earlier run's output", what)
		}
		return next
	}
	for i := int32(1); i <= 2; i++ {
		// A restart asked for after the run began (second precision).
		started := w.get("fc").Status.Runtime.StartedAt.Time
		time.Sleep(time.Until(started.Truncate(time.Second).Add(1100 * time.Millisecond)))
		w.update(t, "fc", func(v *impv1.ImpVM) {
			if v.Annotations == nil {
				v.Annotations = map[string]string{}
			}
			v.Annotations[impv1.RestartRequestedAnnotation] = time.Now().Format(time.RFC3339Nano)
		})
		g.Eventually(func() bool { return w.get("fc").Status.RestartCount == i && ready() }).WithTimeout(3*time.Minute).
			Should(BeTrue(), func() string { return fmt.Sprintf("restart %d: %+v", i, w.get("fc").Status) })
		rec = kept(fmt.Sprintf("restart %d", i), rec)
	}

	// Suspend: a snapshot in the jail, the VMM gone; resume: a new VMM from the snapshot, which
	// goes once loaded. Twice.
	for i := 1; i <= 2; i++ {
		susp := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "fc"},
			Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser}}
		if err := w.c.Client.Create(ctx, susp); err != nil {
			t.Fatal(err)
		}
		g.Eventually(func() impv1.VMPhase { return w.get("fc").Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMSuspended))
		if rec.Alive() {
			t.Errorf("suspension %d: the VMM runs while the VM is suspended", i)
		}
		for _, f := range []string{"vm.state", "vm.mem"} {
			if _, err := os.Stat(filepath.Join(jail, "root", "snapshot", f)); err != nil {
				t.Errorf("suspension %d: snapshot %s: %v", i, f, err)
			}
		}
		if err := w.c.Client.Delete(ctx, susp); err != nil {
			t.Fatal(err)
		}
		g.Eventually(ready).WithTimeout(3*time.Minute).Should(BeTrue(), func() string { return fmt.Sprintf("resume %d: %+v", i, w.get("fc").Status) })
		rec = kept(fmt.Sprintf("resume %d", i), rec)
		if _, err := os.Stat(filepath.Join(jail, "root", "snapshot", "vm.state")); !os.IsNotExist(err) {
			t.Errorf("resume %d: the snapshot stays after it was loaded: %v", i, err)
		}
	}

	// A snapshot (issue 31): the VM paused, its state and memory written in its jail, moved out
	// into the node's store (the agent's, 0600), the VM resumed; a VM started from it loads it
	// in a jail of its own and takes on its own token.
	if err := w.c.Client.Create(ctx, &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "fc-snap"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "fc"}}); err != nil {
		t.Fatal(err)
	}
	snap := &impv1.ImpVMSnapshot{}
	g.Eventually(func() impv1.SnapshotPhase {
		_ = w.c.Client.Get(ctx, types.NamespacedName{Namespace: w.ns, Name: "fc-snap"}, snap)
		return snap.Status.Phase
	}).WithTimeout(time.Minute).Should(Equal(impv1.SnapshotReady), func() string { return fmt.Sprintf("%+v", snap.Status) })
	if snap.Status.Source.VMM != impv1.VMMFirecracker || !ready() {
		t.Errorf("snapshot %+v; the source ready: %v", snap.Status, ready())
	}
	store := filepath.Join(w.stateDir, "snapshots", string(snap.UID))
	for _, f := range []string{"vm.state", "vm.mem", "rw.ext4", "manifest.json"} {
		fi, err := os.Stat(filepath.Join(store, f))
		if err != nil || fi.Mode().Perm() != 0o600 || fi.Sys().(*syscall.Stat_t).Uid != 0 {
			t.Errorf("the snapshot's %s: %v %v", f, fi, err)
		}
	}
	for _, f := range []string{"take.state", "take.mem"} {
		if _, err := os.Stat(filepath.Join(jail, "root", "snapshot", f)); !os.IsNotExist(err) {
			t.Errorf("the snapshot's %s stays in the source's jail: %v", f, err)
		}
	}
	// Taken with the source's workload frozen, which runs on once the snapshot is saved.
	g.Eventually(func() string { b, _ := os.ReadFile(filepath.Join(jail, "root", "guest-frozen")); return string(b) }).
		WithTimeout(30*time.Second).Should(Equal("0"), "the source's workload thawed after the snapshot")
	copyVM := w.vm("fc-copy", "serve")
	copyVM.Spec.VMM, copyVM.Spec.SnapshotRef = impv1.VMMFirecracker, &impv1.SnapshotReference{Name: "fc-snap"}
	copyVM.Spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	if err := w.c.Client.Create(ctx, copyVM); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		v := w.get("fc-copy")
		if v == nil || v.Status.Runtime == nil || !meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition) {
			return fmt.Sprintf("%+v", v.Status)
		}
		return v.Status.Runtime.RestoredFrom
	}).WithTimeout(3 * time.Minute).Should(Equal("fc-snap"))
	cv := w.get("fc-copy")
	copyJail := filepath.Join(w.stateDir, "jail", "firecracker", string(cv.UID), "root")
	var identity struct {
		Restore struct {
			Token   string `json:"token"`
			Entropy string `json:"entropy"`
		} `json:"restore"`
		FrozenAtRestore bool `json:"frozenAtRestore"`
	}
	data, _ = os.ReadFile(filepath.Join(copyJail, "guest-identity.json"))
	_ = json.Unmarshal(data, &identity)
	var cm, sm struct {
		Token string `json:"token"`
	}
	cdata, _ := os.ReadFile(filepath.Join(w.stateDir, "vms", string(cv.UID), "meta.json"))
	_ = json.Unmarshal(cdata, &cm)
	sdata, _ := os.ReadFile(filepath.Join(dir, "meta.json"))
	_ = json.Unmarshal(sdata, &sm)
	if !identity.FrozenAtRestore {
		t.Errorf("the snapshot was taken with the workload running: %s", data)
	}
	if identity.Restore.Token == "" || identity.Restore.Token != cm.Token || cm.Token == sm.Token || len(identity.Restore.Entropy) < 64 {
		t.Errorf("the copy's guest took on %s (its meta: token %q; the source's %q)", data, cm.Token, sm.Token)
	}
	for _, f := range []string{"load.state", "load.mem"} {
		if _, err := os.Stat(filepath.Join(copyJail, "snapshot", f)); !os.IsNotExist(err) {
			t.Errorf("the loaded snapshot's %s stays in the copy's jail: %v", f, err)
		}
	}
	if err := w.c.Client.Delete(ctx, cv); err != nil {
		t.Fatal(err)
	}

	// Disk volumes (issue 32): linked into the jail as the writable disk is, the VM's uid's,
	// attached as drives; the guest finds each by the serial Firecracker gives its file.
	vols := w.vm("fc-vols", "serve")
	vols.Spec.VMM = impv1.VMMFirecracker
	vols.Spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	vols.Spec.Volumes = []impv1.Volume{
		{Name: "scratch", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "32Mi"}},
		{Name: "raw", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "16Mi"}},
	}
	vols.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "scratch", MountPath: "/data"}}
	vols.Spec.VolumeDevices = []impv1.VolumeDevice{{Name: "raw", DevicePath: "/dev/xvdb"}}
	if err := w.c.Client.Create(ctx, vols); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("fc-vols")
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(3*time.Minute).Should(BeTrue(), func() string { return fmt.Sprintf("%+v", w.get("fc-vols").Status) })
	vv := w.get("fc-vols")
	volJail := filepath.Join(w.stateDir, "jail", "firecracker", string(vv.UID), "root")
	found, _ := os.ReadFile(filepath.Join(volJail, "guest-volumes.json"))
	if string(found) != `{"raw":"vol-raw","scratch":"vol-scratch"}` {
		t.Errorf("the guest found its volumes' drives as %s", found)
	}
	var vm2 struct {
		JailUID uint32 `json:"jailUID"`
	}
	data, _ = os.ReadFile(filepath.Join(w.stateDir, "vms", string(vv.UID), "meta.json"))
	_ = json.Unmarshal(data, &vm2)
	for _, name := range []string{"scratch", "raw"} {
		in, err1 := os.Stat(filepath.Join(volJail, "disks", "vol-"+name+".img"))
		out, err2 := os.Stat(filepath.Join(w.stateDir, "vms", string(vv.UID), volume.DiskFile(name)))
		if err1 != nil || err2 != nil || !os.SameFile(in, out) || vm2.JailUID < 300000 || in.Sys().(*syscall.Stat_t).Uid != vm2.JailUID {
			t.Errorf("volume %s in the jail: %v %v %v", name, in, err1, err2)
		}
	}
	if err := w.c.Client.Delete(ctx, vv); err != nil {
		t.Fatal(err)
	}

	v = w.get("fc")
	if err := w.c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() *impv1.ImpVM { return w.get("fc") }).WithTimeout(3 * time.Minute).Should(BeNil())
	if rec.Alive() {
		t.Error("the VMM runs on after deletion")
	}
	if _, err := os.Stat(jail); !os.IsNotExist(err) {
		t.Errorf("the jail remains: %v", err)
	}
}

// fakeJailer builds one static binary that is both the fake jailer and the fake Firecracker it
// copies into the jail and execs there (fctest.FakeJailer), under both names.
func fakeJailer(t *testing.T) (jailer, firecracker string) {
	t.Helper()
	tmp := t.TempDir()
	jailer, firecracker = filepath.Join(tmp, "jailer"), filepath.Join(tmp, "firecracker")
	build := exec.Command("go", "build", "-o", jailer, "github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest/fakejailer")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fake jailer: %v\n%s", err, out)
	}
	if err := os.Link(jailer, firecracker); err != nil {
		t.Fatal(err)
	}
	return jailer, firecracker
}

// TestAStuckBootIsRestarted: a guest that never becomes ready (the fake's says nothing, as one
// whose kernel stalls) has its VMM ended once the agent's boot timeout passes, with a Warning
// Event, and the VM's runStrategy starts a new run in a new VMM.
func TestAStuckBootIsRestarted(t *testing.T) {
	jailer, firecrackerBin := fakeJailer(t)
	t.Setenv(fctest.StuckGuestEnv, "1")
	w := newWorld(t, func(o *agent.Options) {
		o.VMMs = []impv1.VMMKind{impv1.VMMFirecracker}
		o.Firecracker, o.Jailer = firecrackerBin, jailer
		o.BootTimeout = 3 * time.Second
	})
	ctx := context.Background()
	g := NewWithT(t)
	vm := w.vm("stuck", "serve")
	vm.Spec.VMM = impv1.VMMFirecracker
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	var first *vmm.Record
	g.Eventually(func() error {
		v := w.get("stuck")
		if v == nil || v.UID == "" {
			return errors.New("not yet")
		}
		rec, err := vmm.ReadRecord(filepath.Join(w.stateDir, "vms", string(v.UID)))
		first = rec
		return err
	}).WithTimeout(3 * time.Minute).Should(Succeed())
	g.Eventually(func() string {
		v := w.get("stuck")
		var evs eventsv1.EventList
		_ = w.c.Client.List(ctx, &evs, client.InNamespace(w.ns))
		notes := ""
		for _, e := range evs.Items {
			if e.Regarding.UID == v.UID && (e.Reason == impv1.ReasonBootTimeout || e.Reason == "Restarting") {
				notes += e.Type + " " + e.Reason + ": " + e.Note + "\n"
			}
		}
		return fmt.Sprintf("restarts %d\n%s", v.Status.RestartCount, notes)
	}).WithTimeout(3 * time.Minute).Should(And(
		Not(HavePrefix("restarts 0\n")),
		ContainSubstring("Warning BootTimeout: The guest was not ready 3s after its VMM started; its VMM is ended"),
		ContainSubstring("Normal Restarting: Restarting (restart 1) after the workload exited: the guest was not ready 3s after its VMM started")))
	if first.Alive() {
		t.Error("the stuck run's VMM runs on")
	}
	g.Eventually(func() bool {
		v := w.get("stuck")
		rec, err := vmm.ReadRecord(filepath.Join(w.stateDir, "vms", string(v.UID)))
		return err == nil && rec.Pid != first.Pid && rec.Alive()
	}).WithTimeout(3*time.Minute).Should(BeTrue(), "a new VMM for the next run")
}

// TestFirecrackerWarmClaim (issue 48): a warm pool of Firecracker members (the fake jailer's):
// a member is restored with a tenth of a VM's CPU weight (the jailer's cgroup value) and waits
// paused (Firecracker's instance state); a claim is handed it, and its VMM runs on as the claim,
// with a VM's weight, resumed, its guest the claim's (its own token).
func TestFirecrackerWarmClaim(t *testing.T) {
	jailer, firecrackerBin := fakeJailer(t)
	w := newWorld(t, func(o *agent.Options) {
		o.VMMs = []impv1.VMMKind{impv1.VMMFirecracker, impv1.VMMQEMU}
		o.Firecracker, o.Jailer = firecrackerBin, jailer
	})
	c, ns, ctx := w.c, w.ns, context.Background()
	g := NewWithT(t)
	spec := w.vm("", "serve").Spec
	spec.NodeSelector, spec.VMM = nil, impv1.VMMFirecracker
	spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	member := w.idleMember(t, impv1.ImpVMTemplateSpec{VM: spec}, 3*time.Minute)
	root := filepath.Join(w.stateDir, "jail", "firecracker", string(member.UID), "root")
	state := func() string {
		info, err := firecracker.Info(ctx, firecracker.NewJailClient(root))
		if err != nil {
			return err.Error()
		}
		return info.State
	}
	g.Eventually(state).WithTimeout(time.Minute).Should(Equal("Paused"))
	if got := cpuWeight(member.UID); got != "10" && got != "102" {
		t.Errorf("the member's CPU weight %q; want 10 (cgroup v2) or shares 102 (v1)", got)
	}

	claim := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "a"}, Spec: impv1.ImpVMSpec{WarmPoolRef: &impv1.WarmPoolReference{Name: "p"},
		TerminationGracePeriodSeconds: ptr.To[int64](1)}}
	if err := c.Client.Create(ctx, claim); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("a")
		return v != nil && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(3*time.Minute).WithPolling(50*time.Millisecond).Should(BeTrue(), func() string {
		return fmt.Sprintf("%+v; events: %s", w.get("a").Status, eventsOf(c.Client, ns, "a"))
	})
	v := w.get("a")
	if v.Status.Start != impv1.StartWarm || v.HostUID() != member.UID {
		t.Fatalf("the claim started %q under %s; want warm in member %s", v.Status.Start, v.HostUID(), member.UID)
	}
	g.Expect(state()).To(Equal("Running"))
	if got := cpuWeight(member.UID); got != "100" && got != "1024" {
		t.Errorf("the claim's CPU weight %q; want a VM's, 100 (cgroup v2) or shares 1024 (v1)", got)
	}
	var identity struct {
		Restore struct {
			Token string `json:"token"`
		} `json:"restore"`
	}
	data, _ := os.ReadFile(filepath.Join(root, "guest-identity.json"))
	_ = json.Unmarshal(data, &identity)
	m, err := os.ReadFile(filepath.Join(w.stateDir, "vms", string(member.UID), "meta.json"))
	if err != nil || identity.Restore.Token == "" || !strings.Contains(string(m), `"token":"`+identity.Restore.Token+`"`) || !strings.Contains(string(m), `"name":"a"`) {
		t.Errorf("the guest took on %s; the run's record %s (%v)", data, m, err)
	}
}
