package agent_test

import (
	"context"
	"encoding/json"
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
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent"
	"github.com/syscode-labs/imp/internal/agent/vmm"
)

// TestFirecrackerVM runs a VM that asks for Firecracker on a node offering it, with a fake
// jailer standing in for the jailer and Firecracker (this machine has no usable KVM; see
// fctest.FakeJailer): the agent builds the jail, launches the jailer with the VM's uid and
// limits, configures the VM over the API (the strict double), follows the guest channel over
// vsock to Ready, and on deletion stops the VMM and removes the jail.
func TestFirecrackerVM(t *testing.T) {
	// One static binary is both the fake jailer and the fake Firecracker it copies into the
	// jail and execs there (fctest.FakeJailer).
	tmp := t.TempDir()
	jailer, firecrackerBin := filepath.Join(tmp, "jailer"), filepath.Join(tmp, "firecracker")
	build := exec.Command("go", "build", "-o", jailer, "github.com/syscode-labs/imp/internal/agent/vmm/firecracker/fctest/fakejailer")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the fake jailer: %v\n%s", err, out)
	}
	if err := os.Link(jailer, firecrackerBin); err != nil {
		t.Fatal(err)
	}
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
	in, _, err := w.agent.ConsoleInput(types.NamespacedName{Namespace: v.Namespace, Name: v.Name}, v.UID)
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
		v := w.get("fc")
		if v.Annotations == nil {
			v.Annotations = map[string]string{}
		}
		v.Annotations[impv1.RestartRequestedAnnotation] = time.Now().Format(time.RFC3339Nano)
		if err := w.c.Client.Update(ctx, v); err != nil {
			t.Fatal(err)
		}
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
