// Package accesscredentials is the operator's side of a VM's SSH keys (spec.accessCredentials,
// docs/os.md "SSH keys"). While a VM that names them is placed, it reads the Secrets they name
// every RefreshPeriod (the operator watches no Secret: a watch of Secrets would widen its
// rights from the Secrets VMs name to all of them), writes the keys into the VM's run Secret
// and their digest into status.accessCredentials. The node's agent, seeing the digest change,
// gives the guest the keys of the run Secret (internal/agent/accesscredentials).
package accesscredentials

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/accesskeys"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// RefreshPeriod is how often the Secrets of a placed VM's access credentials are read again.
const RefreshPeriod = 5 * time.Second

// ReasonAccessCredentials is the reason of the Events that say a VM's keys could not be read.
const ReasonAccessCredentials = "AccessCredentials"

// EventRecorder records Events about objects (k8s.io/client-go/tools/events).
type EventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// StatusPatcher writes a VM's status as a JSON merge patch (the operator's impvm.StatusPatcher).
type StatusPatcher interface {
	PatchStatus(ctx context.Context, key types.NamespacedName, patch []byte) error
}

// Reconciler refreshes the SSH keys of placed VMs, one VM per request.
type Reconciler struct {
	Client client.Client
	// APIReader reads the tenants' Secrets and the run Secrets, uncached.
	APIReader client.Reader
	Status    StatusPatcher
	Recorder  EventRecorder
	// SecretNamespace holds the run Secrets (runsecret.DefaultNamespace when empty).
	SecretNamespace string
}

// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms/status,verbs=patch
// +kubebuilder:rbac:groups="",resources=secrets,verbs=get

// Reconcile reads the VM's keys, writes them into its run Secret, then their digest into its
// status, and comes back after RefreshPeriod while the VM is placed.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	vm := &impv1.ImpVM{}
	if err := r.Client.Get(ctx, req.NamespacedName, vm); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	ns := r.SecretNamespace
	if ns == "" {
		ns = runsecret.DefaultNamespace
	}
	none := accesskeys.None.Digest()
	if len(vm.Spec.AccessCredentials) == 0 {
		// Named no more: the guest is given no keys, and its users given some before lose
		// them (the guest side records whom it gave keys). The status stays, as none's digest.
		if cur := vm.Status.AccessCredentials; cur == nil || cur.Digest == none {
			return ctrl.Result{}, nil
		}
		if _, err := runsecret.WriteSSHKeys(ctx, r.Client, r.APIReader, ns, vm, accesskeys.None); err != nil && !errors.Is(err, runsecret.ErrNoRunSecret) {
			return ctrl.Result{}, err
		}
		return ctrl.Result{}, r.patch(ctx, vm, &impv1.AccessCredentialsStatus{Digest: none,
			Message: "no access credentials named: the keys given before are taken back"})
	}
	if !vm.DeletionTimestamp.IsZero() || vm.Status.NodeName == "" {
		return ctrl.Result{}, nil
	}
	keys, missing, err := accesskeys.Resolve(ctx, r.APIReader, vm)
	if err != nil {
		// A key that is not one, or a Secret that could not be read: what the guest has stays.
		return r.failed(ctx, vm, err.Error())
	}
	switch _, err := runsecret.WriteSSHKeys(ctx, r.Client, r.APIReader, ns, vm, keys); {
	case errors.Is(err, runsecret.ErrNoRunSecret) && vm.Status.Runtime != nil && vm.Status.Runtime.Instance == vm.Status.Instance &&
		vm.Status.Runtime.Run == vm.Status.RestartCount:
		// Credentials named while the VM runs, whose run needed no Secret when it started:
		// the run's Secret is written now, the keys with it.
		if err := runsecret.Write(ctx, r.Client, r.APIReader, ns, vm); err != nil {
			return ctrl.Result{}, err
		}
	case errors.Is(err, runsecret.ErrNoRunSecret):
		// A run about to start: its own Secret carries the keys; the digest waits for it.
		return ctrl.Result{RequeueAfter: RefreshPeriod}, nil
	case err != nil:
		return ctrl.Result{}, err
	}
	st := &impv1.AccessCredentialsStatus{Digest: keys.Digest(), Message: strings.Join(missing, "; ")}
	if len(missing) > 0 && (vm.Status.AccessCredentials == nil || vm.Status.AccessCredentials.Message != st.Message) {
		r.Recorder.Eventf(vm, nil, "Warning", ReasonAccessCredentials, "Refresh", "%s: their users get no keys from it", st.Message)
	}
	if err := r.patch(ctx, vm, st); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{RequeueAfter: RefreshPeriod}, nil
}

// failed tells why the keys could not be read, keeping the digest the guest has.
func (r *Reconciler) failed(ctx context.Context, vm *impv1.ImpVM, msg string) (ctrl.Result, error) {
	st := &impv1.AccessCredentialsStatus{Message: msg}
	if cur := vm.Status.AccessCredentials; cur != nil {
		st.Digest = cur.Digest
	}
	if cur := vm.Status.AccessCredentials; cur == nil || cur.Message != msg {
		r.Recorder.Eventf(vm, nil, "Warning", ReasonAccessCredentials, "Refresh", "%s: the guest keeps the keys it has", msg)
	}
	if err := r.patch(ctx, vm, st); err != nil {
		return ctrl.Result{}, err
	}
	return ctrl.Result{RequeueAfter: RefreshPeriod}, nil
}

// patch writes status.accessCredentials (removes it when st is nil), if it differs.
func (r *Reconciler) patch(ctx context.Context, vm *impv1.ImpVM, st *impv1.AccessCredentialsStatus) error {
	if cur := vm.Status.AccessCredentials; cur == nil && st == nil || cur != nil && st != nil && *cur == *st {
		return nil
	}
	p, err := json.Marshal(map[string]any{"status": map[string]any{"accessCredentials": st}}) // nil: null, removed
	if err != nil {
		return err
	}
	if err := r.Status.PatchStatus(ctx, client.ObjectKeyFromObject(vm), p); client.IgnoreNotFound(err) != nil {
		return fmt.Errorf("writing status.accessCredentials of %s/%s: %w", vm.Namespace, vm.Name, err)
	}
	return nil
}

// SetupWithManager registers the reconciler for VMs that name access credentials or have a
// status of them to remove.
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	concerned := predicate.NewPredicateFuncs(func(o client.Object) bool {
		vm := o.(*impv1.ImpVM)
		return len(vm.Spec.AccessCredentials) > 0 || vm.Status.AccessCredentials != nil
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("accesscredentials").
		For(&impv1.ImpVM{}, builder.WithPredicates(concerned)).
		Complete(r)
}
