package agent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/guestsession"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// osImage builds (once per machine, cached) the Debian image of hack/os-image.sh and pushes it
// to the test's registry host; it returns the digest reference.
func osImage(t *testing.T, host string) string {
	t.Helper()
	root, err := testcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("hack/os-image.sh", host+"/debian:bookworm")
	cmd.Dir = root
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
	// cloud-init's user data from a Secret of the VM's namespace: a user, a file, a service.
	userData := `#cloud-config
users:
  - name: alice
    shell: /bin/bash
  - name: bob
    shell: /bin/bash
write_files:
  - path: /home/alice/hello.txt
    content: hello from cloud-init
  - path: /etc/imp-marker
    content: imp-user-data-marker-7f3a
  - path: /etc/systemd/system/greeter.service
    content: |
      [Service]
      ExecStart=/bin/sleep infinity
runcmd:
  - [systemctl, start, --no-block, greeter.service]
`
	if err := w.c.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "debian-user-data"},
		StringData: map[string]string{"userdata": userData}}); err != nil {
		t.Fatal(err)
	}
	// SSH keys from a Secret, for alice (whom cloud-init makes: given once she exists), and
	// from a Secret that exists only in another namespace, for bob (he gets none).
	keyDir := t.TempDir()
	pub := func(name string) string {
		if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", keyDir+"/"+name).CombinedOutput(); err != nil {
			t.Fatalf("ssh-keygen: %v: %s", err, out)
		}
		b, err := os.ReadFile(keyDir + "/" + name + ".pub")
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	key1, key2 := pub("key1"), pub("key2")
	keySecret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "debian-keys"}, StringData: map[string]string{"alice": key1}}
	if err := w.c.Client.Create(ctx, keySecret); err != nil {
		t.Fatal(err)
	}
	other := w.c.Namespace(t)
	if err := w.c.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "their-keys"},
		StringData: map[string]string{"k": key2}}); err != nil {
		t.Fatal(err)
	}
	vm := osVM(w, "debian", ref, &impv1.CloudInit{UserDataSecretRef: &impv1.SecretKeyReference{Name: "debian-user-data"}})
	vm.Spec.AccessCredentials = []impv1.AccessCredential{
		{SSHPublicKeys: impv1.SSHPublicKeysSource{SecretName: "debian-keys"}, Users: []string{"alice"}},
		{SSHPublicKeys: impv1.SSHPublicKeysSource{SecretName: "their-keys"}, Users: []string{"bob"}},
	}
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
	t.Logf("systemd-analyze blame (head): %s", tail(run("sh", "-c", "systemd-analyze blame | head -8"), 8))

	// cloud-init ran the user data, as this instance (the VM's UID and placement), and left
	// IMP's network alone.
	if got := run("cloud-init", "status"); !strings.Contains(got, "status: done") {
		t.Errorf("cloud-init status: %q\n%s", got, run("sh", "-c", "tail -30 /var/log/cloud-init-output.log"))
	}
	if got, want := run("cat", "/var/lib/cloud/data/instance-id"), fmt.Sprintf("%s.%d", v.UID, v.Status.Instance); got != want {
		t.Errorf("cloud-init's instance-id %q, want %q", got, want)
	}
	for _, c := range [][2]string{{"id -un alice", "alice"}, {"cat /home/alice/hello.txt", "hello from cloud-init"}, {"systemctl is-active greeter.service", "active"}} {
		if got := run("sh", "-c", c[0]); got != c[1] {
			t.Errorf("the user data's user, file and service: %s says %q, want %q", c[0], got, c[1])
		}
	}
	if got := run("sh", "-c", "ls /etc/cloud/cloud-init.disabled 2>&1; cat /etc/cloud/cloud.cfg.d/99-imp-network.cfg"); !strings.Contains(got, "network: {config: disabled}") || !strings.Contains(got, "No such file") {
		t.Errorf("cloud-init's configuration in the guest: %q", got)
	}
	// alice logs in with key1 by ssh, through a port-forward of the guest's port 22; bob has
	// no keys, and the VM's status says where the operator looked for them.
	ssh := sshThrough(t, w, "debian", v.HostUID(), keyDir)
	g.Eventually(func() string { out, _ := ssh("key1", "alice", "cat hello.txt"); return out }).
		WithTimeout(4*time.Minute).WithPolling(2*time.Second).Should(Equal("hello from cloud-init"), func() string {
		return eventsOf(w.c.Client, w.ns, "debian") + "\n" + run("sh", "-c", "ls -la /home/alice/.ssh; cat /home/alice/.ssh/authorized_keys; journalctl -u ssh --no-pager | tail -20")
	})
	if got := w.get("debian").Status.AccessCredentials; got == nil || got.Digest == "" ||
		got.Message != fmt.Sprintf("accessCredentials[1]: Secret their-keys in namespace %s not found", w.ns) {
		t.Errorf("status.accessCredentials %+v, want a digest and the message that their-keys is not in %s", got, w.ns)
	}
	if got := run("sh", "-c", "id -un bob; cat /home/bob/.ssh/authorized_keys 2>/dev/null"); !strings.HasPrefix(got, "bob") ||
		strings.Contains(got, "BEGIN IMP") || strings.Contains(got, strings.Fields(key2)[1]) {
		t.Errorf("bob (made by cloud-init) and his authorized_keys: %q, want none of IMP's keys", got)
	}
	if got := run("stat", "-c", "%a %U", "/home/alice/.ssh", "/home/alice/.ssh/authorized_keys"); got != "700 alice\n600 alice" {
		t.Errorf("alice's ~/.ssh and authorized_keys: %q, want 700 alice and 600 alice", got)
	}
	// The Secret's key changed, the OS running on: key2 logs in, key1 is refused.
	keySecret.StringData = map[string]string{"alice": key2}
	if err := w.c.Client.Update(ctx, keySecret); err != nil {
		t.Fatal(err)
	}
	rotated := time.Now()
	g.Eventually(func() string { out, _ := ssh("key2", "alice", "cat hello.txt"); return out }).
		WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(Equal("hello from cloud-init"))
	t.Logf("the rotated key logs in %v after the Secret changed", time.Since(rotated).Round(time.Millisecond))
	if out, err := ssh("key1", "alice", "true"); err == nil || !strings.Contains(out, "Permission denied") {
		t.Errorf("after the rotation, key1 logs in: %q %v", out, err)
	}
	// The Secret deleted: its keys are taken back, and alice's own line stays.
	run("sh", "-c", "echo '# alice-own-line' >> /home/alice/.ssh/authorized_keys")
	if err := w.c.Client.Delete(ctx, keySecret); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string { out, _ := ssh("key2", "alice", "true"); return out }).
		WithTimeout(2 * time.Minute).WithPolling(time.Second).Should(ContainSubstring("Permission denied"))
	if got := run("cat", "/home/alice/.ssh/authorized_keys"); got != "# alice-own-line" {
		t.Errorf("after the Secret was deleted, alice's authorized_keys: %q, want only her own line", got)
	}

	// The user data is the VM's alone: not in its status or Events.
	st, _ := json.Marshal(w.get("debian").Status)
	if strings.Contains(string(st), "imp-user-data-marker-7f3a") || strings.Contains(eventsOf(w.c.Client, w.ns, "debian"), "imp-user-data-marker-7f3a") {
		t.Errorf("the user data shows in the VM's status or Events")
	}
	// The guest side's state (the channel's token) and the channel's ports are root's alone.
	got := run("sh", "-c", "stat -c '%a %U' /run/imp/guest.json /run/imp/imp-init; stat -L -c '%a %U' /dev/vport*")
	lines := strings.Split(got, "\n")
	if len(lines) < 3 || lines[0] != "600 root" || lines[1] != "700 root" || slices.ContainsFunc(lines[2:], func(l string) bool { return l != "600 root" }) {
		t.Errorf("the guest side's state and binary, then the channel's ports: %q, want 600 root, 700 root, then 600 root each", got)
	}

	// A VM naming a Secret that exists only in another namespace fails, naming where it looked.
	if err := w.c.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "theirs"},
		StringData: map[string]string{"userdata": "#cloud-config\n"}}); err != nil {
		t.Fatal(err)
	}
	thief := osVM(w, "thief", ref, &impv1.CloudInit{UserDataSecretRef: &impv1.SecretKeyReference{Name: "theirs"}})
	thief.Spec.RunStrategy = impv1.RunStrategyOnce
	if err := w.c.Client.Create(ctx, thief); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		v := w.get("thief")
		if v == nil || v.Status.Runtime == nil {
			return ""
		}
		return v.Status.Runtime.Reason + ": " + v.Status.Runtime.Message
	}).WithTimeout(3 * time.Minute).Should(And(HavePrefix("StartFailed: "),
		ContainSubstring(fmt.Sprintf("cloudInit.userDataSecretRef: Secret theirs in namespace %s", w.ns)), ContainSubstring("not found")))

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

	// Suspended and resumed: the same boot of the OS runs on (its guest side answers again).
	bootID := run("cat", "/proc/sys/kernel/random/boot_id")
	susp := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "debian"},
		Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: "by the test"}}
	if err := w.c.Client.Create(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("debian").Status.Phase }).WithTimeout(6 * time.Minute).Should(Equal(impv1.VMSuspended))
	if err := w.c.Client.Delete(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		v := w.get("debian")
		return v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(6*time.Minute).WithPolling(100*time.Millisecond).Should(BeTrue(), func() string { return tail(w.console(v), 30) })
	if got := run("cat", "/proc/sys/kernel/random/boot_id"); got != bootID {
		t.Errorf("after the resume the OS booted again: boot id %q, was %q", got, bootID)
	}
	if got := run("systemctl", "is-system-running"); got != "running" {
		t.Errorf("after the resume, systemctl is-system-running says %q", got)
	}

	// Stopped (kubectl imp stop: runStrategy Halted), the OS shuts down within the grace
	// period: the console ends with the kernel's power-off; started again, its journal's
	// previous boot ends with systemd's shutdown.
	setRunStrategy := func(rs impv1.RunStrategy) {
		t.Helper()
		cur := w.get("debian")
		orig := cur.DeepCopy()
		cur.Spec.RunStrategy = rs
		if err := w.c.Client.Patch(ctx, cur, client.MergeFrom(orig)); err != nil {
			t.Fatal(err)
		}
	}
	stopped := time.Now()
	setRunStrategy(impv1.RunStrategyHalted)
	var console string
	g.Eventually(func() impv1.VMPhase {
		if c := w.console(v); c != "" {
			console = c
		}
		return w.get("debian").Status.Phase
	}).WithTimeout(3 * time.Minute).WithPolling(100 * time.Millisecond).Should(Equal(impv1.VMStopped))
	took := time.Since(stopped)
	t.Logf("stopped: the OS powered off and the VM was Stopped in %v", took.Round(time.Millisecond))
	if !strings.Contains(console, "reboot: Power down") {
		t.Errorf("stopped, the OS did not power off: its console ends\n%s", tail(console, 30))
	}
	setRunStrategy(impv1.RunStrategyAlways)
	g.Eventually(func() bool {
		v := w.get("debian")
		return v.Status.Phase == impv1.VMRunning && meta.IsStatusConditionTrue(v.Status.Conditions, impv1.ReadyCondition)
	}).WithTimeout(8*time.Minute).WithPolling(200*time.Millisecond).Should(BeTrue(), func() string { return tail(w.console(w.get("debian")), 30) })
	v = w.get("debian")
	if got := run("sh", "-c", "journalctl -b -1 -o cat --no-pager | tail -15"); !strings.Contains(got, "System Power Off") {
		t.Errorf("the journal's previous boot does not end with systemd's power-off:\n%s", got)
	}

	// Deleted, the OS shuts down: the agent's stop is systemd's power-off, seen on the console
	// before the VM's state goes.
	if err := w.c.Client.Delete(ctx, v); err != nil {
		t.Fatal(err)
	}
	var last string
	deleted := time.Now()
	g.Eventually(func() bool {
		if c := w.console(v); c != "" {
			last = c
		}
		return w.get("debian") == nil
	}).WithTimeout(3 * time.Minute).WithPolling(50 * time.Millisecond).Should(BeTrue())
	if !strings.Contains(last, "reboot: Power down") {
		t.Errorf("the OS did not power off: its console ends\n%s", tail(last, 30))
	}
	t.Logf("deleted, the OS powered off and the VM was gone in %v", time.Since(deleted).Round(time.Millisecond))
}

// sshThrough returns a function that runs a command by ssh as user with keyDir's key, through
// a port-forward of the VM's port 22 (the session channel, as kubectl imp port-forward's): its
// output and error.
func sshThrough(t *testing.T, w *world, name string, uid types.UID, keyDir string) func(key, user, command string) (string, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				s, err := w.agent.Runs.Session(types.NamespacedName{Namespace: w.ns, Name: name}, uid)
				if err == nil {
					_ = s.PortForward(context.Background(), 22, c)
				}
			}()
		}
	}()
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	return func(key, user, command string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, "ssh", "-F", "/dev/null", "-i", keyDir+"/"+key, "-p", port, "-o", "BatchMode=yes",
			"-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
			"-o", "ConnectTimeout=50", user+"@127.0.0.1", command).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
