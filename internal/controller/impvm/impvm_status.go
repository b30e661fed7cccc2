package impvm

import (
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// computeStatus sets phase and conditions from what this reconcile observed and decided.
func computeStatus(s *scope, now time.Time) {
	vm := s.vm
	st := &vm.Status
	gen := vm.Generation
	st.Image = vm.Workload().Image // a copy's, a claim's: its template's once placed

	// Scheduled.
	switch {
	case st.NodeName != "":
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionTrue,
			Reason: impv1.ReasonPlaced, Message: fmt.Sprintf("placed on node %s", st.NodeName), ObservedGeneration: gen})
	case s.nodeLost:
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionFalse,
			Reason: impv1.ReasonNodeLost, Message: "the VM's node was lost", ObservedGeneration: gen})
	case s.schedReason != "":
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionFalse,
			Reason: s.schedReason, Message: s.schedMsg, ObservedGeneration: gen})
	case vm.Spec.RunStrategy == impv1.RunStrategyHalted && !isTerminal(st.Phase):
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ScheduledCondition, Status: metav1.ConditionFalse,
			Reason: impv1.ReasonHalted, Message: "runStrategy is Halted", ObservedGeneration: gen})
	}

	phase, ready, reason, msg := phaseOf(vm, now)
	if s.unreachable != "" {
		ready, reason, msg = metav1.ConditionFalse, impv1.ReasonNodeUnreachable, s.unreachable
	} else if s.waitReason != "" && phase == impv1.VMScheduled {
		reason, msg = s.waitReason, s.waitMsg
	}
	st.Phase = phase
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: impv1.ReadyCondition, Status: ready,
		Reason: reason, Message: msg, ObservedGeneration: gen})
	suspended := metav1.Condition{Type: impv1.SuspendedCondition, Status: metav1.ConditionFalse, Reason: impv1.ReasonNotSuspended,
		Message: "the VM is not suspended", ObservedGeneration: gen}
	switch sp := st.Suspension; {
	case sp != nil && phase == impv1.VMSuspended:
		suspended.Status, suspended.Reason, suspended.Message = metav1.ConditionTrue, sp.Reason, sp.Message
	case sp != nil && st.Runtime != nil && st.Runtime.Reason == impv1.ReasonSuspendFailed:
		suspended.Reason, suspended.Message = impv1.ReasonSuspendFailed, st.Runtime.Message
	case sp != nil:
		suspended.Reason, suspended.Message = impv1.ReasonSuspending, "suspending ("+sp.Reason+"): "+sp.Message
	case s.suspendRefused != "":
		suspended.Reason, suspended.Message = impv1.ReasonQuotaExceeded, "not suspended: "+s.suspendRefused
	}
	if sp := st.Suspension; sp != nil || s.suspendRefused != "" || meta.FindStatusCondition(st.Conditions, impv1.SuspendedCondition) != nil {
		meta.SetStatusCondition(&st.Conditions, suspended)
	}
	if rt := currentRun(vm); rt != nil && rt.StartedAt != nil {
		st.StartedAt = rt.StartedAt
	}
}

// phaseOf derives the phase and the Ready condition.
func phaseOf(vm *impv1.ImpVM, now time.Time) (impv1.VMPhase, metav1.ConditionStatus, string, string) {
	st := &vm.Status
	f := metav1.ConditionFalse
	if isTerminal(st.Phase) {
		reason := impv1.ReasonExited
		if st.NodeName == "" || meta.IsStatusConditionFalse(st.Conditions, impv1.ScheduledCondition) {
			reason = impv1.ReasonNodeLost
		}
		msg := "the VM will not run again"
		if rt := currentRun(vm); rt != nil && rt.State == impv1.RuntimeExited {
			msg = "the workload exited: " + exitText(rt)
		}
		return st.Phase, f, reason, msg
	}
	if !vm.DeletionTimestamp.IsZero() {
		return impv1.VMStopping, f, impv1.ReasonExited, "the VM is being deleted"
	}
	halted := vm.Spec.RunStrategy == impv1.RunStrategyHalted
	if st.NodeName == "" {
		if halted {
			return impv1.VMStopped, f, impv1.ReasonHalted, "runStrategy is Halted"
		}
		return impv1.VMPending, f, impv1.ReasonNotScheduled, "waiting for a node"
	}
	rt := currentRun(vm)
	if sp := st.Suspension; sp != nil && !halted && (rt == nil || rt.Reason != impv1.ReasonSuspendFailed) {
		if rt != nil && rt.State == impv1.RuntimeSuspended {
			return impv1.VMSuspended, f, impv1.ReasonSuspended, fmt.Sprintf("suspended (%s): %s", sp.Reason, sp.Message)
		}
		return impv1.VMSuspending, f, impv1.ReasonSuspended, "suspending: " + rt.Message
	}
	if rt != nil && rt.State == impv1.RuntimeSuspended && !halted {
		return impv1.VMStarting, f, impv1.ReasonStarting, "resuming"
	}
	if halted {
		if rt == nil || rt.State == impv1.RuntimeStopped || rt.State == impv1.RuntimeExited {
			return impv1.VMStopped, f, impv1.ReasonHalted, "runStrategy is Halted"
		}
		return impv1.VMStopping, f, impv1.ReasonHalted, "stopping: runStrategy is Halted"
	}
	if rt == nil {
		if st.RestartCount == 0 {
			return impv1.VMScheduled, f, impv1.ReasonStarting, fmt.Sprintf("waiting for node %s to start the VM", st.NodeName)
		}
		return impv1.VMStarting, f, impv1.ReasonStarting, fmt.Sprintf("waiting for node %s to restart the VM", st.NodeName)
	}
	switch rt.State {
	case impv1.RuntimeStarting:
		return impv1.VMStarting, f, impv1.ReasonStarting, rt.Message
	case impv1.RuntimeRunning:
		if rt.GuestReady && rt.Ready != nil && !*rt.Ready {
			return impv1.VMRunning, f, impv1.ReasonNotServing, rt.Message
		}
		if rt.GuestReady {
			return impv1.VMRunning, metav1.ConditionTrue, impv1.ReasonGuestReady, "the guest reported ready"
		}
		return impv1.VMRunning, f, impv1.ReasonGuestNotReady, "the guest has not reported ready yet"
	case impv1.RuntimeExited:
		msg := "the workload exited: " + exitText(rt)
		if st.NextRestartAt != nil {
			msg += fmt.Sprintf("; restarting in %s", st.NextRestartAt.Sub(now).Round(time.Second))
		}
		return impv1.VMStarting, f, impv1.ReasonBackoff, msg
	case impv1.RuntimeStopped:
		return impv1.VMStopped, f, impv1.ReasonExited, "stopped by its node"
	}
	return impv1.VMStarting, f, impv1.ReasonStartFailed, rt.Message
}

// announced remembers, per VM and kind of transition, the value the operator's last reconcile
// of the VM computed (a wait's reason, the phase). The cache's copy of a VM can lag the
// operator's own status patch by a reconcile (its finalizer's patch wakes the next reconcile at
// once): one that read the older copy, without what was just written, would announce the same
// transition twice (seen once in CI: two Unschedulable Events for one wait). An operator that
// restarted remembers nothing and goes by the status alone, as before.
type announced struct{ m sync.Map } // announcedKey → announcedValue

type announcedKey struct {
	vm   types.NamespacedName
	kind string
}

type announcedValue struct {
	uid   types.UID
	value string
}

// The kinds of transition recordTransition announces.
const (
	announceWait        = "wait"
	announceSuspend     = "suspend"
	announceUnreachable = "unreachable"
	announcePhase       = "phase"
)

var announceKinds = []string{announceWait, announceSuspend, announceUnreachable, announcePhase}

// changed records value as the VM's kind of transition now and says whether the last
// reconcile of this VM (of its UID) computed another.
func (a *announced) changed(vm *impv1.ImpVM, kind, value string) bool {
	v := announcedValue{uid: vm.UID, value: value}
	old, loaded := a.m.Swap(announcedKey{vm: client.ObjectKeyFromObject(vm), kind: kind}, v)
	return !loaded || old.(announcedValue) != v
}

// forget drops what is remembered of the VM of that name (it is gone).
func (a *announced) forget(name types.NamespacedName) {
	for _, kind := range announceKinds {
		a.m.Delete(announcedKey{vm: name, kind: kind})
	}
}

// news records value as the VM's kind of transition now and says whether it is to be
// announced: set, other than in the status the reconcile read (was), and other than what the
// last reconcile computed.
func (a *announced) news(vm *impv1.ImpVM, kind, value, was string) bool {
	return a.changed(vm, kind, value) && value != "" && value != was
}

// ifSet is reason when cond holds, else "".
func ifSet(cond bool, reason string) string {
	if cond {
		return reason
	}
	return ""
}

// recordTransition emits the Events and metrics of what this reconcile changed: what differs
// from the status it read and from what the last reconcile computed.
func (r *Reconciler) recordTransition(s *scope) {
	vm := s.vm
	if s.schedReason != "" {
		placementFailures.WithLabelValues(s.schedReason).Inc()
	}
	if r.announced.news(vm, announceWait, s.schedReason, s.oldSchedReason) {
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "Unschedulable", "Place", "%s: %s", s.schedReason, s.schedMsg)
	}
	if r.announced.news(vm, announceSuspend, ifSet(s.suspendRefused != "", impv1.ReasonQuotaExceeded), s.oldSuspReason) {
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonQuotaExceeded, "Suspend", "Not suspending the VM: %s", s.suspendRefused)
	}
	if r.announced.news(vm, announceUnreachable, ifSet(s.unreachable != "", impv1.ReasonNodeUnreachable), s.oldReadyReason) {
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, impv1.ReasonNodeUnreachable, "Wait", "%s", s.unreachable)
	}
	if !r.announced.news(vm, announcePhase, string(vm.Status.Phase), string(s.oldPhase)) {
		return
	}
	switch vm.Status.Phase {
	case impv1.VMStarting:
		if rt := currentRun(vm); rt != nil && rt.State == impv1.RuntimeSuspended {
			return // resuming: Resuming and Resumed tell it
		}
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Starting", "Start", "Node %s is starting the VM", vm.Status.NodeName)
	case impv1.VMRunning:
		if rt := currentRun(vm); rt != nil && rt.Message == impv1.RuntimeResumedMessage {
			return // the agent records Resumed, with how long it took
		}
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Started", "Start", "The VM runs on node %s", vm.Status.NodeName)
		if vm.Status.Instance == 1 && vm.Status.RestartCount == 0 {
			took := r.Clock.Since(vm.CreationTimestamp.Time).Seconds()
			createToRunning.Observe(took)
			if vm.IsClaim() {
				claimToRunning.WithLabelValues(string(vm.Status.Start)).Observe(took)
			}
		}
	case impv1.VMStopping:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Stopping", "Stop", "Stopping the VM")
	case impv1.VMStopped:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Stopped", "Stop", "The VM is stopped")
	case impv1.VMSucceeded:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeNormal, "Succeeded", "Exit", "The VM's workload finished successfully; runStrategy %s does not restart it", vm.Spec.RunStrategy)
	case impv1.VMFailed:
		r.Recorder.Eventf(vm, nil, corev1.EventTypeWarning, "Failed", "Exit", "The VM failed and runStrategy %s does not restart it", vm.Spec.RunStrategy)
	}
}
