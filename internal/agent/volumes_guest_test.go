package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/volume"
)

// TestVolumesInTheGuest runs a real guest with every volume kind IMP makes on the node: an
// emptyDisk mounted and one raw at a device path, a Secret's keys as files with their modes, a
// ConfigMap's key by subPath, the VM's labels and name by downwardAPI, and an optional Secret
// that does not exist. What the guest wrote to its disks is there after a restart, the
// rotated Secret's new value too; the volumes of files are read-only. A VM of another
// namespace naming this one's Secret fails with a reason that says where it looked.
func TestVolumesInTheGuest(t *testing.T) {
	w := newWorld(t)
	c, ctx := w.c, context.Background()
	g := NewWithT(t)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "tls"},
		StringData: map[string]string{"crt": "cert-1", "key": "key-1"}}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "conf"},
		Data: map[string]string{"app.conf": "level=1", "other": "x"}}
	for _, o := range []client.Object{secret, cm} {
		if err := c.Client.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	volumes := func(vm *impv1.ImpVM) {
		vm.Spec.Volumes = []impv1.Volume{
			{Name: "scratch", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "64Mi"}},
			{Name: "raw", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "16Mi"}},
			{Name: "certs", Secret: &impv1.SecretVolumeSource{SecretName: "tls", DefaultMode: ptr.To[int32](0o440),
				Items: []impv1.KeyToPath{{Key: "crt", Path: "tls/server.crt"}, {Key: "key", Path: "tls/server.key", Mode: ptr.To[int32](0o400)}}}},
			{Name: "conf", ConfigMap: &impv1.ConfigMapVolumeSource{Name: "conf"}},
			{Name: "info", DownwardAPI: &impv1.DownwardAPIVolumeSource{Items: []impv1.DownwardAPIVolumeFile{
				{Path: "labels", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.labels"}},
				{Path: "name", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.name"}},
				{Path: "tier", FieldRef: impv1.ObjectFieldSelector{FieldPath: "metadata.labels['tier']"}}}}},
			{Name: "none", Secret: &impv1.SecretVolumeSource{SecretName: "absent", Optional: ptr.To(true)}},
		}
		vm.Spec.VolumeMounts = []impv1.VolumeMount{
			{Name: "scratch", MountPath: "/data"},
			{Name: "certs", MountPath: "/etc/certs"},
			{Name: "conf", MountPath: "/etc/app/app.conf", SubPath: "app.conf"},
			{Name: "info", MountPath: "/etc/info"},
			{Name: "none", MountPath: "/opt/none"},
		}
		vm.Spec.VolumeDevices = []impv1.VolumeDevice{{Name: "raw", DevicePath: "/dev/xvdb"}}
	}
	vm := w.vm("vols", "serve")
	vm.Labels = map[string]string{"app": "vols", "tier": "test"}
	volumes(vm)
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	ready := func(name string) func() string {
		return func() string {
			v := w.get(name)
			if v == nil || v.Status.Runtime == nil {
				return "absent"
			}
			cond := meta.FindStatusCondition(v.Status.Conditions, impv1.ReadyCondition)
			if cond == nil || cond.Status != metav1.ConditionTrue || v.Status.Runtime.Run != v.Status.RestartCount || !v.Status.Runtime.GuestReady {
				return fmt.Sprintf("%s %+v", v.Status.Phase, *v.Status.Runtime)
			}
			return "ready"
		}
	}
	waitReady := func(name string) {
		t.Helper()
		g.Eventually(ready(name)).WithTimeout(9*time.Minute).Should(Equal("ready"), func() string {
			return diagnose(c.Client, w.get(name), func(string) string { return w.stateDir })
		})
	}
	try := w.tryExec
	exec := func(args ...string) string {
		t.Helper()
		out, err := try("vols", args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	waitReady("vols")

	files := map[string]string{ // path → content
		"/etc/certs/tls/server.crt": "cert-1",
		"/etc/certs/tls/server.key": "key-1",
		"/etc/app/app.conf":         "level=1",
		"/etc/info/labels":          "app=\"vols\"\ntier=\"test\"",
		"/etc/info/name":            "vols",
		"/etc/info/tier":            "test",
	}
	for p, want := range files {
		if got := exec("tool-read", p); got != want {
			t.Errorf("%s holds %q, want %q", p, got, want)
		}
	}
	for p, want := range map[string]string{"/etc/certs/tls/server.crt": "440", "/etc/certs/tls/server.key": "400", "/etc/info/name": "644"} {
		if got := exec("tool-mode", p); got != want {
			t.Errorf("%s has mode %s, want %s", p, got, want)
		}
	}
	if got := exec("tool-absent", "/etc/app/other"); got != "" {
		t.Errorf("subPath mounted more than its file: %s", got)
	}
	if _, err := try("vols", "tool-touch", "/etc/certs/planted"); err == nil {
		t.Error("the guest wrote into a Secret volume")
	}
	if _, err := try("vols", "tool-write", "/etc/info/name", "other"); err == nil {
		t.Error("the guest rewrote a downwardAPI file")
	}
	exec("tool-write", "/data/keep", "persisted")
	// On its raw volume the guest writes a configuration disk's magic with a length past the
	// bound, and the base disk's ext4 label: a boot that took the volume for its configuration
	// or base disk would fail on it.
	const planted = "IMPCONF1    rawbytes"
	exec("tool-write", "/dev/xvdb", planted)
	exec("tool-write", "/dev/xvdb", "imp-base", fmt.Sprint(1024+0x78))

	// On the node: the disks are the VM's own files in its state directory, sized as asked,
	// and nothing of the Secret's values lingers beside its configuration disk.
	dir := filepath.Join(w.stateDir, "vms", string(w.get("vols").UID))
	for name, size := range map[string]int64{"scratch": 64 << 20, "raw": 16 << 20} {
		fi, err := os.Stat(filepath.Join(dir, volume.DiskFile(name)))
		if err != nil || fi.Size() != size || fi.Mode().Perm() != 0o600 {
			t.Errorf("volume %s's disk: %v, %v", name, fi, err)
		}
	}

	// Rotate the Secret and restart: the disks kept what the guest wrote, the files are the
	// new run's.
	secret.StringData = map[string]string{"crt": "cert-2", "key": "key-2"}
	if err := c.Client.Update(ctx, secret); err != nil {
		t.Fatal(err)
	}
	w.update(t, "vols", func(v *impv1.ImpVM) {
		v.Annotations = map[string]string{impv1.RestartRequestedAnnotation: time.Now().Format(time.RFC3339Nano)}
	})
	g.Eventually(func() int32 { return w.get("vols").Status.RestartCount }).WithTimeout(3 * time.Minute).Should(BeNumerically(">=", 1))
	waitReady("vols")
	// The new run's session (the old run's may still be the one the agent holds a moment).
	g.Eventually(func() error { _, err := try("vols", "tool-true"); return err }).WithTimeout(time.Minute).Should(Succeed())
	if got := exec("tool-read", "/data/keep"); got != "persisted" {
		t.Errorf("the emptyDisk lost what the guest wrote: %q", got)
	}
	if got := exec("tool-head", "/dev/xvdb", fmt.Sprint(len(planted))); got != planted {
		t.Errorf("the raw emptyDisk lost what the guest wrote: %q", got)
	}
	if got := exec("tool-read", "/etc/certs/tls/server.crt"); got != "cert-2" {
		t.Errorf("the restarted run's Secret file: %q", got)
	}

	// Suspended and resumed: the disks are attached again, the files as they were.
	susp := &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: "vols"}, Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser}}
	if err := c.Client.Create(ctx, susp); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() impv1.VMPhase { return w.get("vols").Status.Phase }).WithTimeout(3 * time.Minute).Should(Equal(impv1.VMSuspended))
	if err := c.Client.Delete(ctx, susp); err != nil {
		t.Fatal(err)
	}
	waitReady("vols")
	g.Eventually(func() error { _, err := try("vols", "tool-true"); return err }).WithTimeout(time.Minute).Should(Succeed())
	if got := exec("tool-read", "/data/keep"); got != "persisted" {
		t.Errorf("after a resume the emptyDisk holds %q", got)
	}
	exec("tool-write", "/data/after-resume", "ok")
	if got := exec("tool-read", "/etc/certs/tls/server.crt"); got != "cert-2" {
		t.Errorf("after a resume the Secret file holds %q", got)
	}

	// Another namespace's VM cannot name this namespace's Secret: the run fails, saying where
	// it looked.
	other := c.Namespace(t)
	thief := w.vm("thief", "serve")
	thief.Namespace = other
	thief.Spec.RunStrategy = impv1.RunStrategyOnce
	thief.Spec.Volumes = []impv1.Volume{{Name: "certs", Secret: &impv1.SecretVolumeSource{SecretName: "tls"}}}
	thief.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "certs", MountPath: "/etc/certs"}}
	if err := c.Client.Create(ctx, thief); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() string {
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, types.NamespacedName{Namespace: other, Name: "thief"}, v); err != nil || v.Status.Runtime == nil {
			return ""
		}
		return v.Status.Runtime.Reason + ": " + v.Status.Runtime.Message
	}).WithTimeout(3 * time.Minute).Should(And(HavePrefix("StartFailed: "),
		ContainSubstring(fmt.Sprintf("volume certs: Secret tls in namespace %s", other)), ContainSubstring("not found")))

	// Deleted: its disks go with it.
	if err := c.Client.Delete(ctx, w.get("vols")); err != nil {
		t.Fatal(err)
	}
	g.Eventually(func() bool {
		_, err := os.Stat(filepath.Join(dir, volume.DiskFile("scratch")))
		return os.IsNotExist(err)
	}).WithTimeout(3 * time.Minute).Should(BeTrue())
}
