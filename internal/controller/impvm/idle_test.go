package impvm_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
)

// reportRuntime merge-patches fields of the VM's status.runtime, as its node's agent does.
func (e *env) reportRuntime(name string, fields map[string]any) {
	e.t.Helper()
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"runtime": fields}})
	if err := e.c.Status().Patch(context.Background(), e.get(name), client.RawPatch(types.MergePatchType, patch)); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) suspension(name string) *impv1.ImpVMSuspension {
	s := &impv1.ImpVMSuspension{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, s); err != nil {
		return nil
	}
	return s
}

// TestIdleVMsAreSuspendedAndWoken (issue 49): a VM whose node reports it idle for its
// suspendAfter gets an ImpVMSuspension of reason Idle (and is suspended as by any), and is
// woken (its suspension deleted) when its node reports that something arrived for it. A VM
// without the policy, or not idle long enough, is left alone; a person's suspension is never
// woken by traffic; removing the policy wakes an idle VM.
func TestIdleVMsAreSuspendedAndWoken(t *testing.T) {
	e := newEnv(t)
	e.node("a", 8, 8)
	e.startOperator()
	e.startAgent(nil)
	g := NewWithT(t)
	phase := func(name string) func() impv1.VMPhase {
		return func() impv1.VMPhase { return e.get(name).Status.Phase }
	}

	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.20.0.0/24"}})
	for _, name := range []string{"idle", "plain", "recent", "held"} {
		vm := e.vm(name, 1, "256Mi")
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		if name != "plain" {
			after := 10 * time.Second
			if name == "recent" {
				after = time.Hour
			}
			vm.Spec.Idle = &impv1.IdlePolicy{SuspendAfter: metav1.Duration{Duration: after}}
		}
		e.create(vm)
		eventually(t, phase(name)).Should(Equal(impv1.VMRunning))
	}
	long := time.Now().Add(-time.Minute).UTC().Format(time.RFC3339)
	for _, name := range []string{"idle", "plain", "recent"} {
		e.reportRuntime(name, map[string]any{"idleSince": long})
	}
	eventually(t, phase("idle")).Should(Equal(impv1.VMSuspended))
	s := e.suspension("idle")
	g.Expect(s).NotTo(BeNil())
	g.Expect(s.Spec.Reason).To(Equal(impv1.SuspendReasonIdle))
	g.Expect(s.OwnerReferences).To(HaveLen(1))
	g.Expect(s.OwnerReferences[0].UID).To(Equal(e.get("idle").UID), "gone with its VM")
	g.Expect(e.get("idle").Status.Suspension.Reason).To(Equal(impv1.SuspendReasonIdle))
	consistently(t, func() *impv1.ImpVMSuspension { return e.suspension("plain") }, time.Second).Should(BeNil())
	g.Expect(e.suspension("recent")).To(BeNil(), "suspended before its suspendAfter")

	// Something arrives for it: its node asks, the suspension goes, the VM runs again.
	e.reportRuntime("idle", map[string]any{"wakeRequested": metav1.Now().UTC().Format(time.RFC3339)})
	eventually(t, func() *impv1.ImpVMSuspension { return e.suspension("idle") }).Should(BeNil())
	eventually(t, phase("idle")).Should(Equal(impv1.VMRunning))
	g.Expect(e.events()["Idle"]).To(BeNumerically(">=", 1))
	g.Expect(e.events()["Waking"]).To(BeNumerically(">=", 1))

	// A person's suspension is not the node's to wake.
	e.create(&impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "held"}, Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser}})
	eventually(t, phase("held")).Should(Equal(impv1.VMSuspended))
	e.reportRuntime("held", map[string]any{"wakeRequested": metav1.Now().UTC().Format(time.RFC3339)})
	consistently(t, phase("held"), 2*time.Second).Should(Equal(impv1.VMSuspended))

	// Idle again, then the policy removed: woken.
	e.reportRuntime("idle", map[string]any{"idleSince": long})
	eventually(t, phase("idle")).Should(Equal(impv1.VMSuspended))
	// A merge patch: the VM's status moves meanwhile (the agent double's reports), which an
	// update made from an older copy would conflict with.
	if err := e.c.Patch(context.Background(), e.get("idle"), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"idle":null}}`))); err != nil {
		t.Fatal(err)
	}
	eventually(t, phase("idle")).Should(Equal(impv1.VMRunning))

	// An Idle suspension a quota keeps from applying (no suspended memory allowed) is removed
	// once the VM is at work again, rather than applied to it later.
	e.create(&impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "q"}, Spec: impv1.ImpQuotaSpec{Hard: impv1.QuotaResources{SuspendedMemory: ptr.To(resource.MustParse("0"))}}})
	late := e.vm("late", 1, "256Mi")
	late.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	late.Spec.Idle = &impv1.IdlePolicy{SuspendAfter: metav1.Duration{Duration: 10 * time.Second}}
	e.create(late)
	eventually(t, phase("late")).Should(Equal(impv1.VMRunning))
	e.reportRuntime("late", map[string]any{"idleSince": long})
	eventually(t, func() *impv1.ImpVMSuspension { return e.suspension("late") }).ShouldNot(BeNil())
	consistently(t, phase("late"), time.Second).Should(Equal(impv1.VMRunning)) // refused by the quota
	e.reportRuntime("late", map[string]any{"idleSince": nil})
	eventually(t, func() *impv1.ImpVMSuspension { return e.suspension("late") }).Should(BeNil())
}
