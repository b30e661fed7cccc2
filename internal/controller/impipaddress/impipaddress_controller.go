// Package impipaddress keeps what NetworkPolicies read of a VM on its ImpIPAddress: the VM's
// labels and named ports (spec.vmLabels, spec.vmPorts). Every node's agent caches the
// ImpIPAddresses, which change only when a VM is placed, moves, leaves or is relabelled, and
// selects a policy's peer VMs from them: no agent hears of the status changes of every VM.
package impipaddress

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// Reconciler copies a VM's labels and named ports onto its addresses.
type Reconciler struct {
	Client client.Client
}

// +kubebuilder:rbac:groups=imp.dev,resources=impipaddresses,verbs=get;list;watch;patch
// +kubebuilder:rbac:groups=imp.dev,resources=impvms,verbs=get;list;watch

// Reconcile makes the address carry its VM's labels and named ports.
func (r *Reconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	ip := &impv1.ImpIPAddress{}
	if err := r.Client.Get(ctx, req.NamespacedName, ip); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	vm := &impv1.ImpVM{}
	err := r.Client.Get(ctx, types.NamespacedName{Namespace: ip.Namespace, Name: ip.Spec.VMRef.Name}, vm)
	if apierrors.IsNotFound(err) || (err == nil && vm.UID != ip.Spec.VMRef.UID) {
		return ctrl.Result{}, nil // the VM is gone: its address goes with it
	}
	if err != nil {
		return ctrl.Result{}, fmt.Errorf("getting VM %s: %w", ip.Spec.VMRef.Name, err)
	}
	ports := impv1.NamedPorts(vm.Spec.Ports)
	if equality.Semantic.DeepEqual(labelsOrNil(ip.Spec.VMLabels), labelsOrNil(vm.Labels)) && equality.Semantic.DeepEqual(ip.Spec.VMPorts, ports) {
		return ctrl.Result{}, nil
	}
	orig := ip.DeepCopy()
	ip.Spec.VMLabels, ip.Spec.VMPorts = vm.Labels, ports
	if err := r.Client.Patch(ctx, ip, client.MergeFrom(orig)); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(fmt.Errorf("writing the labels of VM %s on address %s: %w", vm.Name, ip.Name, err))
	}
	return ctrl.Result{}, nil
}

func labelsOrNil(m map[string]string) map[string]string {
	if len(m) == 0 {
		return nil
	}
	return m
}

// SetupWithManager has mgr run the reconciler: for each address as it is made, and for a
// VM's addresses when its labels or declared ports change (not its status).
func (r *Reconciler) SetupWithManager(mgr ctrl.Manager) error {
	relabelled := predicate.TypedFuncs[client.Object]{
		CreateFunc:  func(event.TypedCreateEvent[client.Object]) bool { return false },
		DeleteFunc:  func(event.TypedDeleteEvent[client.Object]) bool { return false },
		GenericFunc: func(event.TypedGenericEvent[client.Object]) bool { return false },
		UpdateFunc: func(e event.TypedUpdateEvent[client.Object]) bool {
			o, n := e.ObjectOld.(*impv1.ImpVM), e.ObjectNew.(*impv1.ImpVM)
			return !equality.Semantic.DeepEqual(o.Labels, n.Labels) || !equality.Semantic.DeepEqual(o.Spec.Ports, n.Spec.Ports)
		},
	}
	addresses := handler.EnqueueRequestsFromMapFunc(func(ctx context.Context, o client.Object) []reconcile.Request {
		var list impv1.ImpIPAddressList
		if err := r.Client.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingLabels{impv1.VMUIDLabel: string(o.GetUID())}); err != nil {
			ctrl.LoggerFrom(ctx).Error(err, "listing the VM's addresses")
			return nil
		}
		reqs := make([]reconcile.Request, 0, len(list.Items))
		for _, ip := range list.Items {
			reqs = append(reqs, reconcile.Request{NamespacedName: client.ObjectKeyFromObject(&ip)})
		}
		return reqs
	})
	onCreate := predicate.Funcs{
		UpdateFunc: func(event.UpdateEvent) bool { return false },
		DeleteFunc: func(event.DeleteEvent) bool { return false },
	}
	return ctrl.NewControllerManagedBy(mgr).Named("impipaddress").
		For(&impv1.ImpIPAddress{}, builder.WithPredicates(onCreate)).
		Watches(&impv1.ImpVM{}, addresses, builder.WithPredicates(relabelled)).
		Complete(r)
}
