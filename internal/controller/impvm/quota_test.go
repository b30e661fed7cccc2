package impvm_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/testcluster"
)

// placed counts the namespace's VMs that hold a placement, and what they hold.
func (e *env) placed() (vms, vcpus int, memGi int64) {
	for _, v := range e.list() {
		if v.Status.NodeName != "" && v.Status.Resources != nil {
			vms++
			vcpus += int(v.Status.Resources.VCPUs)
			memGi += v.Status.Resources.Memory.Value() >> 30
		}
	}
	return vms, vcpus, memGi
}

func (e *env) quota(name string, vcpus int32, mem string) *impv1.ImpQuota {
	return &impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: impv1.ImpQuotaSpec{Hard: impv1.QuotaResources{VCPUs: ptr.To(vcpus), Memory: ptr.To(resource.MustParse(mem))}}}
}

func (e *env) setQuota(name string, vcpus int32, mem string) {
	e.t.Helper()
	q := &impv1.ImpQuota{}
	if err := e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, q); err != nil {
		e.t.Fatal(err)
	}
	orig := q.DeepCopy()
	q.Spec.Hard.VCPUs, q.Spec.Hard.Memory = ptr.To(vcpus), ptr.To(resource.MustParse(mem))
	// A patch: the quota controller writes the status meanwhile, which an update would race.
	if err := e.c.Patch(context.Background(), q, client.MergeFrom(orig)); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) quotaSummary(name string) impv1.QuotaSummary {
	q := &impv1.ImpQuota{}
	_ = e.c.Get(context.Background(), client.ObjectKey{Namespace: e.ns, Name: name}, q)
	return q.Status.Summary
}

// TestQuotaBoundsANamespace (the operator binary as the chart's identity): with 8 vCPUs / 8Gi, exactly 8 of 10 VMs of 1 vCPU / 1Gi are
// placed and 2 say which limit stops them; a deletion places one; a lower quota places
// nothing and evicts nothing; a higher one places the rest. The status and kubectl follow.
func TestQuotaBoundsANamespace(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.startAgent(nil)
	e.startOperatorProcess()
	e.create(e.quota("team", 8, "8Gi"))
	for i := range 10 {
		e.create(e.vm(name("vm", i), 1, "1Gi"))
	}
	eventually(t, func() int { n, _, _ := e.placed(); return n }).Should(Equal(8))
	waiting := func() []string {
		var out []string
		for _, v := range e.list() {
			if c := condition(&v, impv1.ScheduledCondition); c != nil && c.Reason == impv1.ReasonQuotaExceeded {
				out = append(out, c.Message)
			}
		}
		return out
	}
	eventually(t, waiting).Should(HaveLen(2))
	for _, m := range waiting() {
		if !strings.Contains(m, "ImpQuota team: vcpus 8 of 8 used, asked 1") && !strings.Contains(m, "ImpQuota team: memory 8Gi of 8Gi used, asked 1Gi") {
			t.Errorf("QuotaExceeded message %q does not name the limit and the amounts", m)
		}
	}
	// One Event per waiting VM says so (other reasons a VM waited for before have their own).
	quotaEvents := func() map[string]int {
		var l corev1.EventList
		_ = e.c.List(context.Background(), &l, client.InNamespace(e.ns))
		out := map[string]int{}
		for _, ev := range l.Items {
			if ev.Reason == "Unschedulable" && strings.Contains(ev.Message, impv1.ReasonQuotaExceeded+": ImpQuota team:") {
				out[ev.InvolvedObject.Name]++
			}
		}
		return out
	}
	eventually(t, quotaEvents).Should(HaveLen(2))
	consistently(t, quotaEvents, time.Second).Should(HaveEach(1))
	eventually(t, func() impv1.QuotaSummary { return e.quotaSummary("team") }).
		Should(Equal(impv1.QuotaSummary{VMs: "8", VCPUs: "8/8", Memory: "8Gi/8Gi", Disk: "8Gi"}))
	out, err := testcluster.Kubectl(e.cl.Kubeconfig(t), "get", "impquota", "-n", e.ns)
	if err != nil || !strings.Contains(out, "VMS") || !strings.Contains(out, "8/8") || !strings.Contains(out, "8Gi/8Gi") {
		t.Errorf("kubectl get impquota:\n%s%v", out, err)
	}

	// One goes: one waiting VM takes its place.
	var victim *impv1.ImpVM
	for _, v := range e.list() {
		if v.Status.NodeName != "" {
			victim = &v
			break
		}
	}
	if err := e.c.Delete(context.Background(), victim); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() int { return len(e.list()) }).Should(Equal(9))
	eventually(t, func() int { n, _, _ := e.placed(); return n }).Should(Equal(8))
	eventually(t, waiting).Should(HaveLen(1))

	// Lower: nothing new, nothing evicted.
	e.setQuota("team", 4, "4Gi")
	eventually(t, func() string { return e.quotaSummary("team").VCPUs }).Should(Equal("8/4"))
	consistently(t, func() int { n, _, _ := e.placed(); return n }, 2*time.Second).Should(Equal(8))

	// Raise: the waiting VM is placed.
	e.setQuota("team", 16, "16Gi")
	eventually(t, func() int { n, _, _ := e.placed(); return n }).Should(Equal(9))
	eventually(t, func() string { return e.quotaSummary("team").VCPUs }).Should(Equal("9/16"))
}

// TestQuotaHoldsAcrossOperatorRestarts: 30 VMs created while the operator (the binary) is
// killed and started twice; a watcher sampling all along never sees more than the quota placed.
func TestQuotaHoldsAcrossOperatorRestarts(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.startAgent(nil)
	kill := e.startOperatorProcess()
	e.create(e.quota("team", 12, "12Gi"))
	var worst atomic.Int32
	done := make(chan struct{})
	go func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(20 * time.Millisecond):
			}
			if n, cpus, _ := e.placed(); int32(max(n, cpus)) > worst.Load() {
				worst.Store(int32(max(n, cpus)))
			}
		}
	}()
	defer close(done)
	for i := range 30 {
		e.create(e.vm(fmt.Sprintf("vm-%02d", i), 1, "1Gi"))
		switch i {
		case 8, 20:
			kill()
			kill = e.startOperatorProcess()
		}
	}
	eventually(t, func() int { n, _, _ := e.placed(); return n }).Should(Equal(12))
	consistently(t, func() int { n, _, _ := e.placed(); return n }, 2*time.Second).Should(Equal(12))
	if w := worst.Load(); w > 12 {
		t.Errorf("at one point %d VMs (or vCPUs) were placed under a quota of 12", w)
	}
}

// TestSuspendedMemoryQuota: a user's suspension that would take the namespace past its
// suspendedMemory is not carried out, and says why.
func TestSuspendedMemoryQuota(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.startAgent(nil)
	e.startOperator()
	q := e.quota("team", 16, "16Gi")
	q.Spec.Hard.SuspendedMemory = ptr.To(resource.MustParse("1Gi"))
	e.create(q, e.vm("a", 1, "1Gi"), e.vm("b", 1, "1Gi"))
	for _, n := range []string{"a", "b"} {
		eventually(t, func() impv1.VMPhase { return e.get(n).Status.Phase }).Should(Equal(impv1.VMRunning))
	}
	for _, n := range []string{"a", "b"} {
		e.create(&impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: n},
			Spec: impv1.ImpVMSuspensionSpec{Reason: impv1.SuspendReasonUser, Message: "test"}})
		if n == "a" {
			eventually(t, func() bool { return e.get("a").Status.Suspension != nil }).Should(BeTrue())
		}
	}
	eventually(t, func() string {
		if c := condition(e.get("b"), impv1.SuspendedCondition); c != nil {
			return c.Reason + ": " + c.Message
		}
		return ""
	}).Should(Equal(impv1.ReasonQuotaExceeded + ": not suspended: ImpQuota team: suspendedMemory 1Gi of 1Gi used, asked 1Gi"))
	if e.get("b").Status.Suspension != nil {
		t.Error("b was suspended past the quota")
	}
}

// TestQuotaAdmissionPolicy: with the chart's admission policy, kubectl apply refuses at once a
// VM that alone exceeds its namespace's quota, or names a class it does not allow, and
// accepts one that fits.
func TestQuotaAdmissionPolicy(t *testing.T) {
	e := newEnv(t)
	e.cl.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	q := e.quota("team", 8, "8Gi")
	q.Spec.PerVM = &impv1.PerVMBounds{Disk: ptr.To(resource.MustParse("10Gi"))}
	e.create(q)
	kc := e.cl.Kubeconfig(t)
	apply := func(name string, vcpus int, mem, disk string, flags ...string) (string, error) {
		manifest := fmt.Sprintf(`apiVersion: imp.dev/v1alpha1
kind: ImpVM
metadata: {name: %s, namespace: %s}
spec:
  image: registry.test/app:1
  resources: {vcpus: %d, memory: %s}
  diskSize: %s
`, name, e.ns, vcpus, mem, disk)
		path := t.TempDir() + "/vm.yaml"
		if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		return testcluster.Kubectl(kc, append([]string{"apply", "-f", path}, flags...)...)
	}
	// The policy's binding takes a moment to be served: probe with server-side dry runs, which
	// pass admission but store nothing.
	eventually(t, func() string { out, _ := apply("huge", 16, "1Gi", "1Gi", "--dry-run=server"); return out }).
		Should(ContainSubstring("ImpQuota team: the VM alone asks for 16 vCPUs, more than the quota of 8"))
	if out, err := apply("huge", 16, "1Gi", "1Gi"); err == nil || !strings.Contains(out, "more than the quota of 8") {
		t.Errorf("a VM of 16 vCPUs was not refused: %v\n%s", err, out)
	}
	for _, tt := range []struct{ name, mem, disk, want string }{
		{"too-much-memory", "16Gi", "1Gi", "ImpQuota team: the VM alone asks for 16Gi memory, more than the quota of 8Gi"},
		{"too-much-disk", "1Gi", "20Gi", "ImpQuota team: a VM may have at most 10Gi disk"},
	} {
		if out, err := apply(tt.name, 1, tt.mem, tt.disk); err == nil || !strings.Contains(out, tt.want) {
			t.Errorf("%s: %v\n%s; want refused with %q", tt.name, err, out, tt.want)
		}
	}
	if out, err := apply("fits", 2, "2Gi", "1Gi"); err != nil {
		t.Errorf("a VM that fits was refused: %v\n%s", err, out)
	}
	// Disk volumes count with the writable disk.
	for _, tt := range []struct{ name, capacity, want string }{
		{"big-volume", "10Gi", "ImpQuota team: a VM may have at most 10Gi disk (its diskSize and disk volumes)"},
		{"small-volume", "8Gi", ""},
	} {
		path := t.TempDir() + "/vm.yaml"
		manifest := fmt.Sprintf("apiVersion: imp.dev/v1alpha1\nkind: ImpVM\nmetadata: {name: %s, namespace: %s}\nspec:\n  image: registry.test/app:1\n  resources: {vcpus: 1, memory: 1Gi}\n  diskSize: 1Gi\n  volumes: [{name: scratch, emptyDisk: {capacity: %s}}]\n", tt.name, e.ns, tt.capacity)
		if err := os.WriteFile(path, []byte(manifest), 0o600); err != nil {
			t.Fatal(err)
		}
		out, err := testcluster.Kubectl(kc, "apply", "-f", path)
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(out, tt.want)) {
			t.Errorf("%s: %v\n%s; want %q", tt.name, err, out, tt.want)
		}
	}
	// A namespace's allowed classes: a VM must name one; a copy names none (the operator checks
	// its template's class), and is admitted.
	classes := &impv1.ImpQuota{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "classes"}, Spec: impv1.ImpQuotaSpec{AllowedClasses: []string{"small"}}}
	e.create(classes)
	eventually(t, func() string { out, _ := apply("classless", 1, "1Gi", "1Gi", "--dry-run=server"); return out }).
		Should(ContainSubstring("ImpQuota classes: the VM must name one of the classes small"))
	copyPath := t.TempDir() + "/copy.yaml"
	if err := os.WriteFile(copyPath, []byte(fmt.Sprintf("apiVersion: imp.dev/v1alpha1\nkind: ImpVM\nmetadata: {name: copy, namespace: %s}\nspec:\n  templateRef: {name: web}\n", e.ns)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := testcluster.Kubectl(kc, "apply", "-f", copyPath); err != nil {
		t.Errorf("a copy of a template was refused in a namespace with allowed classes: %v\n%s", err, out)
	}
}

// TestDiskVolumesCount: a VM's emptyDisk volumes are resolved into its placement and count with
// its writable disk against the namespace's ImpQuota, as the operator places it.
func TestDiskVolumesCount(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.startAgent(nil)
	e.startOperator()
	q := e.quota("team", 8, "8Gi")
	q.Spec.Hard.Disk = ptr.To(resource.MustParse("3Gi"))
	e.create(q)
	for i := range 2 {
		vm := e.vm(name("vm", i), 1, "1Gi") // a writable disk of 1Gi, and:
		vm.Spec.Volumes = []impv1.Volume{{Name: "scratch", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "1Gi"}}}
		vm.Spec.VolumeMounts = []impv1.VolumeMount{{Name: "scratch", MountPath: "/data"}}
		e.create(vm)
	}
	eventually(t, func() int { n, _, _ := e.placed(); return n }).Should(Equal(1))
	var placed, waiting impv1.ImpVM
	eventually(t, func() string {
		for _, v := range e.list() {
			if v.Status.NodeName != "" {
				placed = v
			} else if c := condition(&v, impv1.ScheduledCondition); c != nil && c.Reason == impv1.ReasonQuotaExceeded {
				waiting = v
			}
		}
		if c := condition(&waiting, impv1.ScheduledCondition); c != nil {
			return c.Message
		}
		return ""
	}).Should(ContainSubstring("ImpQuota team: disk 2Gi of 3Gi used, asked 2Gi"))
	if r := placed.Status.Resources; r == nil || r.VolumeDiskSize == nil || r.VolumeDiskSize.String() != "1Gi" {
		t.Errorf("the placed VM's resources %+v", r)
	}
	eventually(t, func() string { return e.quotaSummary("team").Disk }).Should(Equal("2Gi/3Gi"))
}

// TestOnlyTheOperatorClaimsPressure: with the chart's admission policy, a tenant with the
// chart's imp-edit role cannot create an ImpVMSuspension of reason PressureLifecycle (which
// skips the suspendedMemory quota and blames memory pressure), nor change one of its own to
// it; reason User is theirs, and the operator's identity may claim pressure.
func TestOnlyTheOperatorClaimsPressure(t *testing.T) {
	e := newEnv(t)
	e.cl.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	ctx := context.Background()
	_ = e.cl.As(t, testcluster.Operator) // the chart's roles, imp-edit included
	tenant := e.tenant("ClusterRole", "imp-edit")
	operator, err := client.New(e.cl.As(t, testcluster.Operator), client.Options{Scheme: e.cl.Scheme})
	if err != nil {
		t.Fatal(err)
	}
	susp := func(name, reason string) *impv1.ImpVMSuspension {
		return &impv1.ImpVMSuspension{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpVMSuspensionSpec{Reason: reason}}
	}
	create := func(cl client.Client, s *impv1.ImpVMSuspension) error { return cl.Create(ctx, s, client.DryRunAll) }
	// The policy takes a moment to be in force.
	eventually(t, func() error { return create(tenant, susp("probe", impv1.SuspendReasonPressure)) }).
		Should(MatchError(ContainSubstring("only IMP's operator suspends a VM for PressureLifecycle")))
	if err := create(tenant, susp("mine", impv1.SuspendReasonUser)); err != nil {
		t.Errorf("the tenant cannot suspend for reason User: %v", err)
	}
	s := susp("changed", impv1.SuspendReasonUser)
	if err := tenant.Create(ctx, s); err != nil {
		t.Fatal(err)
	}
	s.Spec.Reason = impv1.SuspendReasonPressure
	if err := tenant.Update(ctx, s); err == nil || !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) {
		t.Errorf("the tenant changed its suspension's reason to PressureLifecycle: %v", err)
	}
	if err := create(operator, susp("pressure", impv1.SuspendReasonPressure)); err != nil {
		t.Errorf("the operator cannot suspend for pressure: %v", err)
	}
}

// TestAnAddressWithoutAPlacementIsReleased: the operator is killed (a failpoint) between
// claiming a VM's address, which names the node it chose, and writing the placement. When the
// operator is back and the VM has no room any more, the VM waits unplaced holding no address
// (it held one naming a node it is not on, draining the network); once there is room again it
// is placed with an address.
func TestAnAddressWithoutAPlacementIsReleased(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	node := e.node("only", 4, 4)
	e.startAgent(nil)
	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "small"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.40.0.0/29"}})
	_, exited := e.startOperatorProcessWith(failpoint.EnvVar + "=operator-address-claimed")
	vm := e.vm("waits", 1, "1Gi")
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "small"}
	e.create(vm)
	select {
	case <-exited:
	case <-time.After(2 * time.Minute):
		t.Fatal("the operator never reached its failpoint")
	}
	addresses := func() []string {
		var list impv1.ImpIPAddressList
		if err := e.c.List(ctx, &list, client.InNamespace(e.ns)); err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, a := range list.Items {
			out = append(out, a.Spec.Address+"@"+a.Spec.NodeName)
		}
		return out
	}
	if got := addresses(); len(got) != 1 || e.get("waits").Status.NodeName != "" {
		t.Fatalf("after the crash: addresses %v, node %q; want one address and no placement", got, e.get("waits").Status.NodeName)
	}
	// No room now: the node leaves the VM's pool.
	patch := client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"imp.test/pool":null}}}`))
	if err := e.c.Patch(ctx, node, patch); err != nil {
		t.Fatal(err)
	}
	e.startOperator()
	eventually(t, func() string { return scheduled(e.get("waits")) }).Should(Equal(impv1.ReasonNoNodeAvailable))
	eventually(t, addresses).Should(BeEmpty(), "a VM that waits for room holds an address")
	// Room again: placed, with an address.
	patch = client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"labels":{"imp.test/pool":"`+e.pool+`"}}}`))
	if err := e.c.Patch(ctx, node, patch); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("waits").Status.IP }).ShouldNot(BeEmpty())
	if got := addresses(); len(got) != 1 || !strings.HasSuffix(got[0], "@"+node.Name) {
		t.Errorf("placed: addresses %v, want one naming %s", got, node.Name)
	}
}

// endOnceVMUnderDiskQuota makes the quota team (10Gi of disk) and the Once VM "once" of 8Gi of
// disk, and waits for the VM to end (the agent double must make it exit).
func (e *env) endOnceVMUnderDiskQuota() {
	q := e.quota("team", 16, "16Gi")
	q.Spec.Hard.Disk = ptr.To(resource.MustParse("10Gi"))
	once := e.vm("once", 1, "1Gi")
	once.Spec.RunStrategy = impv1.RunStrategyOnce
	once.Spec.DiskSize = ptr.To(resource.MustParse("8Gi"))
	e.create(q, once)
	eventually(e.t, func() impv1.VMPhase { return e.get("once").Status.Phase }).Should(Equal(impv1.VMSucceeded))
}

// TestAnEndedVMsDiskIsCounted (issue 27, item 6): a Once VM that ended keeps its disk on its
// node for the agent's retention; until the agent says it removed it, the disk counts against
// the namespace's disk quota (another VM waits, QuotaExceeded), and the ImpQuota's status says
// so. Once the disk is gone, the waiting VM is placed.
func TestAnEndedVMsDiskIsCounted(t *testing.T) {
	e := newEnv(t)
	e.node("big", 64, 64)
	e.startAgent(func(vm *impv1.ImpVM) *int32 {
		if vm.Name == "once" {
			return ptr.To[int32](0)
		}
		return nil
	})
	e.startOperator()
	e.endOnceVMUnderDiskQuota()

	next := e.vm("next", 1, "1Gi")
	next.Spec.DiskSize = ptr.To(resource.MustParse("4Gi"))
	e.create(next)
	eventually(t, func() string {
		if c := condition(e.get("next"), impv1.ScheduledCondition); c != nil {
			return c.Reason + ": " + c.Message
		}
		return ""
	}).Should(ContainSubstring(impv1.ReasonQuotaExceeded + ": ImpQuota team: disk 8Gi of 10Gi used, asked 4Gi"))
	eventually(t, func() string { return e.quotaSummary("team").Disk }).Should(Equal("8Gi/10Gi"))

	// The agent's retention removed the disks.
	vm := e.get("once")
	rt := vm.Status.Runtime.DeepCopy()
	rt.DisksRemoved = true
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"runtime": rt}})
	if err := e.c.Status().Patch(context.Background(), vm, client.RawPatch(types.MergePatchType, patch)); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("next").Status.NodeName }).ShouldNot(BeEmpty())
	eventually(t, func() string { return e.quotaSummary("team").Disk }).Should(Equal("4Gi/10Gi"))
}

// TestAnEndedVMOfADeletedNodeHoldsNothing: the disks of a VM that ended go with its node; once
// the Node is deleted, the VM leaves it and its disk no longer counts.
func TestAnEndedVMOfADeletedNodeHoldsNothing(t *testing.T) {
	e := newEnv(t)
	node := e.node("gone", 64, 64)
	e.startAgent(func(*impv1.ImpVM) *int32 { return ptr.To[int32](0) })
	e.startOperator()
	e.endOnceVMUnderDiskQuota()
	eventually(t, func() string { return e.quotaSummary("team").Disk }).Should(Equal("8Gi/10Gi"))
	if err := e.c.Delete(context.Background(), node); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("once").Status.NodeName }).Should(BeEmpty())
	eventually(t, func() string { return e.quotaSummary("team").Disk }).Should(Equal("0/10Gi"))
}
