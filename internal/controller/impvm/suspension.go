package impvm

import (
	"time"

	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/placement"
)

// +kubebuilder:rbac:groups=imp.dev,resources=impvmsuspensions,verbs=get;list;watch

// reconcileSuspension turns an ImpVMSuspension of the VM's name into status.suspension, which
// the VM's agent acts on (suspend while set, resume when cleared), and records when the VM's
// VMM is gone. A suspended VM keeps its placement and what it holds on its node: its state is
// on that node's disk, and resuming must find its memory there.
func (r *Reconciler) reconcileSuspension(ctx context.Context, s *scope) error {
	vm := s.vm
	st := &vm.Status
	var susp impv1.ImpVMSuspension
	err := r.Client.Get(ctx, types.NamespacedName{Namespace: vm.Namespace, Name: vm.Name}, &susp)
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("reading the VM's suspension: %w", err)
	}
	rt := currentRun(vm)
	want := err == nil && st.NodeName != "" && !isTerminal(st.Phase) && vm.Spec.RunStrategy != impv1.RunStrategyHalted
	switch {
	case want && st.Suspension == nil:
		if rt == nil || rt.State != impv1.RuntimeRunning {
			return nil // only a running VM is suspended; a starting one is when it runs
		}
		// A user's suspension counts against the namespace's suspendedMemory quota; the
		// pressure lifecycle's never waits on a quota: the node needs the memory.
		var quotas []placement.Quota
		if susp.Spec.Reason != impv1.SuspendReasonPressure {
			qs, err := r.namespaceQuotas(ctx, vm.Namespace)
			if err != nil {
				return err
			}
			quotas = qs
		}
		if why := r.Ledger.Suspend(vm.UID, quotas); why != "" {
			s.suspendRefused = why
			s.requeueAfter(30 * time.Second) // another VM's resume frees room without an event here
			return nil
		}
		st.Suspension = &impv1.SuspensionStatus{Reason: susp.Spec.Reason, Message: susp.Spec.Message}
		r.Recorder.Eventf(vm, &susp, corev1.EventTypeNormal, "Suspending", "Suspend", "Suspending the VM on node %s (%s): %s",
			st.NodeName, susp.Spec.Reason, susp.Spec.Message)
	case !want && st.Suspension != nil:
		st.Suspension = nil
		r.Ledger.Resume(vm.UID)
		if rt != nil && rt.State == impv1.RuntimeSuspended {
			r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Resuming", "Resume", "Resuming the VM on node %s", st.NodeName)
		}
	}
	if st.Suspension != nil && st.Suspension.Since == nil && rt != nil && rt.State == impv1.RuntimeSuspended {
		now := metav1.NewTime(r.Clock.Now())
		st.Suspension.Since = &now
		if res := st.Resources; res != nil {
			mem := res.Memory.DeepCopy()
			st.Suspension.MemoryReleased = &mem
		}
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Suspended", "Suspend", "Suspended on node %s (%s); %s of memory freed",
			st.NodeName, st.Suspension.Reason, st.Suspension.MemoryReleased.String())
	}
	return nil
}
