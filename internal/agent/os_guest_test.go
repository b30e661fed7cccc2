package agent_test

import (
	"bytes"
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
)

// osImage builds (once per machine, cached) the Debian image of hack/os-image.sh and pushes it
// to the test's registry host; it returns the digest reference.
func osImage(t *testing.T, host string) string {
	t.Helper()
	cmd := exec.Command("hack/os-image.sh", host+"/debian:bookworm")
	cmd.Dir = "../.."
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("hack/os-image.sh: %v: %s", err, stderr.String())
	}
	lines := strings.Fields(string(out))
	if len(lines) == 0 {
		t.Fatalf("hack/os-image.sh printed no image: %s", stderr.String())
	}
	return lines[len(lines)-1]
}

// TestAnOSBootsItsInit: an ImpVM of boot OS, the Debian image of hack/os-image.sh, boots the
// image's systemd as PID 1 under QEMU/TCG, with IMP's guest side as a service of it: the VM
// is Ready once systemd says the system is running, exec reaches the OS (its hostname the
// VM's, PID 1 systemd, the guest side in a unit of its own), and deleting the VM shuts the
// OS down.
func TestAnOSBootsItsInit(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	ref := osImage(t, w.host)
	vm := w.vm("debian")
	vm.Spec.Image, vm.Spec.Args, vm.Spec.Boot = ref, nil, impv1.BootOS
	vm.Spec.Resources.Memory = ptr.To(resource.MustParse("512Mi"))
	vm.Spec.DiskSize = ptr.To(resource.MustParse("256Mi"))
	if err := w.c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	g := NewWithT(t)
	began := time.Now()
	g.Eventually(func() string {
		v := w.get("debian")
		if c := meta.FindStatusCondition(v.Status.Conditions, impv1.ReadyCondition); c != nil {
			if v.Status.RestartCount > 0 {
				StopTrying("the OS's run ended: " + c.Message + "\nconsole:\n" + tail(w.console(v), 60)).Now()
			}
			return string(c.Status) + "/" + c.Reason + ": " + c.Message
		}
		return string(v.Status.Phase)
	}).WithTimeout(9*time.Minute).WithPolling(200*time.Millisecond).Should(HavePrefix("True/GuestReady"), func() string {
		return "console:\n" + tail(w.console(w.get("debian")), 60)
	})
	t.Logf("the Debian VM was Ready %v after its creation", time.Since(began).Round(time.Millisecond))

	v := w.get("debian")
	run := func(argv ...string) string {
		t.Helper()
		s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: w.ns, Name: "debian"}, v.HostUID())
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		err = s.Exec(ctx, guestsession.ExecOptions{Command: argv, Stdout: &out, Stderr: &out})
		if err != nil && !strings.Contains(err.Error(), "exit") {
			t.Fatalf("exec %v: %v: %s", argv, err, out.String())
		}
		return strings.TrimSpace(out.String())
	}
	if got := run("systemctl", "is-system-running"); got != "running" {
		t.Errorf("systemctl is-system-running says %q; failed units:\n%s", got, run("systemctl", "--failed", "--no-legend"))
	}
	if got := run("cat", "/proc/1/comm"); got != "systemd" {
		t.Errorf("PID 1 is %q, want systemd", got)
	}
	if got := run("hostname"); got != "debian" {
		t.Errorf("the OS's hostname is %q, want the VM's name", got)
	}
	if got := run("systemctl", "is-active", "imp-guest.service"); got != "active" {
		t.Errorf("the guest side's unit is %q", got)
	}
	t.Logf("systemd-analyze: %s", run("systemd-analyze"))

	// Its snapshots are not built yet: refused, and the OS runs on.
	snap := &impv1.ImpVMSnapshot{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "debian"}, Spec: impv1.ImpVMSnapshotSpec{VMName: "debian"}}
	if err := w.c.Client.Create(ctx, snap); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		_ = w.c.Client.Get(ctx, client.ObjectKeyFromObject(snap), snap)
		return string(snap.Status.Phase) + "/" + snap.Status.Reason
	}).WithTimeout(time.Minute).Should(Equal(string(impv1.SnapshotFailed) + "/" + impv1.ReasonSnapshotVMBootsAnOS))
	if got := run("systemctl", "is-system-running"); got != "running" {
		t.Errorf("after the refused snapshot, systemctl is-system-running says %q", got)
	}

	// Deleted, the OS shuts down: the agent's stop is systemd's power-off, seen on the console
	// before the VM's state goes.
	if err := w.c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	var last string
	g.Eventually(func() bool {
		if c := w.console(v); c != "" {
			last = c
		}
		return w.get("debian") == nil
	}).WithTimeout(3 * time.Minute).WithPolling(50 * time.Millisecond).Should(BeTrue())
	if !strings.Contains(last, "reboot: Power down") {
		t.Errorf("the OS did not power off: its console ends\n%s", tail(last, 30))
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
