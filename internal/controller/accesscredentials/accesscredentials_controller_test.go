package accesscredentials

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/accesskeys"
	"github.com/syscode-labs/imp/internal/runsecret"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

type events []string

func (e *events) Eventf(_, _ runtime.Object, typ, reason, _, note string, args ...interface{}) {
	*e = append(*e, typ+" "+reason+" "+fmt.Sprintf(note, args...))
}

type patcher struct{ c client.Client }

func (p patcher) PatchStatus(ctx context.Context, key types.NamespacedName, patch []byte) error {
	return p.c.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}, client.RawPatch(types.MergePatchType, patch))
}

const (
	ed1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHJ0b2VtZ2ZzZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2Rm one@imp"
	ed2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDJ0b2VtZ2ZzZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2RmZ2Rm two@imp"
)

// TestRefresh, as the operator with the chart's rights: a placed VM's keys go into its run
// Secret and their digest into its status; a changed Secret changes both; a Secret only
// another namespace has gives its users no keys and the status names where it looked; a
// Secret holding a line that is no key changes nothing the guest has and says why; a VM that
// no longer names credentials gives its guest none; credentials named on a running VM whose
// run had no Secret get one.
func TestRefresh(t *testing.T) {
	c := testcluster.Require(t, shared)
	ctx := context.Background()
	ns, other := c.Namespace(t), c.Namespace(t)
	const secretNS = "imp-system"
	if err := c.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: secretNS}}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	op, err := client.New(c.As(t, "imp-operator"), client.Options{Scheme: c.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	keys := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "keys"}, StringData: map[string]string{"a": ed1}}
	for _, s := range []*corev1.Secret{keys, {ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: "theirs"}, StringData: map[string]string{"b": ed2}}} {
		if err := c.Client.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "os"}, Spec: impv1.ImpVMSpec{
		Image: "registry.example.com/os:1", Boot: impv1.BootOS,
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("512Mi"))},
		AccessCredentials: []impv1.AccessCredential{
			{SSHPublicKeys: impv1.SSHPublicKeysSource{SecretName: "keys"}, Users: []string{"alice", "root"}},
			{SSHPublicKeys: impv1.SSHPublicKeysSource{SecretName: "theirs"}, Users: []string{"bob"}},
		}}}
	if err := c.Client.Create(ctx, vm); err != nil {
		t.Fatal(err)
	}
	vm.Status.NodeName, vm.Status.Instance = "node-a", 1
	if err := c.Client.Status().Update(ctx, vm); err != nil {
		t.Fatal(err)
	}
	if err := runsecret.Write(ctx, op, op, secretNS, vm); err != nil {
		t.Fatal(err)
	}
	// The run's own write carries the keys as they are: the refresh finds nothing to write.
	now, _, err := accesskeys.Resolve(ctx, op, vm)
	if err != nil {
		t.Fatal(err)
	}
	if wrote, err := runsecret.WriteSSHKeys(ctx, op, op, secretNS, vm, now); err != nil || wrote {
		t.Errorf("the refresh after the run's write wrote again (%v, %v)", wrote, err)
	}
	var ev events
	r := &Reconciler{Client: op, APIReader: op, Status: patcher{op}, Recorder: &ev, SecretNamespace: secretNS}
	refresh := func() (*impv1.ImpVM, accesskeys.Keys) {
		t.Helper()
		res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: client.ObjectKeyFromObject(vm)})
		if err != nil {
			t.Fatal(err)
		}
		v := &impv1.ImpVM{}
		if err := c.Client.Get(ctx, client.ObjectKeyFromObject(vm), v); err != nil {
			t.Fatal(err)
		}
		if len(v.Spec.AccessCredentials) > 0 && res.RequeueAfter != RefreshPeriod {
			t.Errorf("requeued after %v, want %v", res.RequeueAfter, RefreshPeriod)
		}
		run, err := runsecret.Read(ctx, op, secretNS, v)
		if err != nil {
			t.Fatal(err)
		}
		k, _, err := run.SSHKeys()
		if err != nil {
			t.Fatal(err)
		}
		return v, k
	}

	v, k := refresh()
	want := accesskeys.Keys{"alice": {ed1}, "root": {ed1}, "bob": {}}
	if k.Digest() != want.Digest() || v.Status.AccessCredentials == nil || v.Status.AccessCredentials.Digest != want.Digest() {
		t.Fatalf("the run's keys %v, status %+v; want %v and its digest", k, v.Status.AccessCredentials, want)
	}
	if msg := v.Status.AccessCredentials.Message; msg != fmt.Sprintf("accessCredentials[1]: Secret theirs in namespace %s not found", ns) {
		t.Errorf("status message %q, want the namespace it looked in", msg)
	}

	// The Secret changes: the run's keys and the digest follow.
	keys.StringData = map[string]string{"a": ed2}
	if err := c.Client.Update(ctx, keys); err != nil {
		t.Fatal(err)
	}
	v, k = refresh()
	want = accesskeys.Keys{"alice": {ed2}, "root": {ed2}, "bob": {}}
	if k.Digest() != want.Digest() || v.Status.AccessCredentials.Digest != want.Digest() {
		t.Errorf("after the change, the run's keys %v, status %+v; want %v", k, v.Status.AccessCredentials, want)
	}

	// A line that is no key: what the guest has stays, and the status says why.
	keys.StringData = map[string]string{"a": `command="/bin/sh" not-a-key`}
	if err := c.Client.Update(ctx, keys); err != nil {
		t.Fatal(err)
	}
	v, k = refresh()
	if k.Digest() != want.Digest() || v.Status.AccessCredentials.Digest != want.Digest() ||
		!strings.Contains(v.Status.AccessCredentials.Message, "Secret keys in namespace "+ns+": key a, line 1: not an SSH public key") {
		t.Errorf("after a bad line, the run's keys %v, status %+v; want the keys kept and the line named", k, v.Status.AccessCredentials)
	}
	if len(ev) < 2 || !strings.Contains(strings.Join(ev, "\n"), "Warning AccessCredentials") {
		t.Errorf("events %q", ev)
	}

	// No credentials named any more: the run's keys and the digest are none's, so that the
	// guest's users given keys lose them.
	v.Spec.AccessCredentials = nil
	if err := c.Client.Update(ctx, v); err != nil {
		t.Fatal(err)
	}
	if v, _ = refresh(); v.Status.AccessCredentials == nil || v.Status.AccessCredentials.Digest != accesskeys.None.Digest() {
		t.Errorf("after the VM named none, status.accessCredentials %+v; want none's digest", v.Status.AccessCredentials)
	}

	// Credentials named on a running VM whose run needed no Secret: the run's Secret is
	// written with the keys, then the digest.
	bare := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bare"}, Spec: impv1.ImpVMSpec{
		Image: "registry.example.com/os:1", Boot: impv1.BootOS,
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("512Mi"))}}}
	if err := c.Client.Create(ctx, bare); err != nil {
		t.Fatal(err)
	}
	bare.Status.NodeName, bare.Status.Instance = "node-a", 1
	bare.Status.Runtime = &impv1.RuntimeStatus{Instance: 1, State: impv1.RuntimeRunning}
	if err := c.Client.Status().Update(ctx, bare); err != nil {
		t.Fatal(err)
	}
	bare.Spec.AccessCredentials = []impv1.AccessCredential{{SSHPublicKeys: impv1.SSHPublicKeysSource{SecretName: "keys"}, Users: []string{"alice"}}}
	if err := c.Client.Update(ctx, bare); err != nil {
		t.Fatal(err)
	}
	vm = bare
	keys.StringData = map[string]string{"a": ed1}
	if err := c.Client.Update(ctx, keys); err != nil {
		t.Fatal(err)
	}
	v, k = refresh()
	if want := (accesskeys.Keys{"alice": {ed1}}); k.Digest() != want.Digest() || v.Status.AccessCredentials == nil || v.Status.AccessCredentials.Digest != want.Digest() {
		t.Errorf("credentials named on a running VM: the run's keys %v, status %+v; want %v", k, v.Status.AccessCredentials, want)
	}
}
