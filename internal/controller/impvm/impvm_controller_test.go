package impvm_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/nodereport"
	"github.com/syscode-labs/imp/internal/runsecret"
)

// parallel runs f(i) for i in [0, n) on workers goroutines.
func parallel(n, workers int, f func(i int)) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				f(i)
			}
		}()
	}
	wg.Wait()
}

// TestPlacementNeverOverbooks creates 200 VMs at once over 5 nodes that can hold 60 of them
// and checks that no node holds more than its agent reported.
func TestPlacementNeverOverbooks(t *testing.T) {
	e := newEnv(t)
	caps := map[string][2]int64{} // node → vcpus, memory
	for i, c := range [][2]int64{{8, 4}, {4, 8}, {16, 16}, {2, 64}, {8, 2}} {
		n := e.node(name("n", i), int32(c[0]), c[1])
		caps[n.Name] = [2]int64{c[0], c[1] * gi}
	}
	e.startOperator()
	const total = 200
	parallel(total, 20, func(i int) {
		if err := e.c.Create(context.Background(), e.vm(name("vm", i), 1, "512Mi")); err != nil {
			t.Errorf("creating: %v", err)
		}
	})
	// Every VM gets a decision.
	eventually(t, func() int {
		decided := 0
		for _, vm := range e.list() {
			if scheduled(&vm) != "" {
				decided++
			}
		}
		return decided
	}).Should(Equal(total))

	used := map[string][2]int64{}
	placed := 0
	for _, vm := range e.list() {
		switch scheduled(&vm) {
		case "True":
			placed++
			u := used[vm.Status.NodeName]
			u[0] += int64(vm.Status.Resources.VCPUs)
			u[1] += vm.Status.Resources.Memory.Value()
			used[vm.Status.NodeName] = u
		case impv1.ReasonNoNodeAvailable:
		default:
			t.Errorf("VM %s: unexpected Scheduled reason %q", vm.Name, scheduled(&vm))
		}
	}
	want := 0
	for n, c := range caps {
		if used[n][0] > c[0] || used[n][1] > c[1] {
			t.Errorf("node %s overbooked: holds %d vCPUs, %d bytes; reported %d vCPUs, %d bytes", n, used[n][0], used[n][1], c[0], c[1])
		}
		want += int(min(c[0], c[1]/(gi/2)))
	}
	if placed != want {
		t.Errorf("placed %d VMs, want %d (every node filled)", placed, want)
	}
	unplaced := e.get(name("vm", 0))
	for _, vm := range e.list() {
		if scheduled(&vm) != "True" {
			unplaced = &vm
			break
		}
	}
	if c := condition(unplaced, impv1.ScheduledCondition); c == nil || c.Message == "" || c.Reason != impv1.ReasonNoNodeAvailable {
		t.Errorf("an unplaced VM's Scheduled condition: %+v", c)
	}
	t.Logf("placed %d of %d; an unplaced VM says: %s", placed, total, condition(unplaced, impv1.ScheduledCondition).Message)

	// Freed capacity is used: deleting a placed VM lets an unplaced one in.
	e.startAgent(nil)
	var victim impv1.ImpVM
	for _, vm := range e.list() {
		if scheduled(&vm) == "True" {
			victim = vm
			break
		}
	}
	if err := e.c.Delete(context.Background(), &victim); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() int {
		n := 0
		for _, vm := range e.list() {
			if scheduled(&vm) == "True" {
				n++
			}
		}
		return n
	}).Should(Equal(want))
	eventually(t, func() *impv1.ImpVM { return e.get(victim.Name) }).Should(BeNil())
}

// TestAddressesStayUniqueAcrossRestarts creates and deletes 500 VMs concurrently while the
// operator is stopped and started twice, and checks that no two live VMs ever hold one
// address and that nothing leaks.
func TestAddressesStayUniqueAcrossRestarts(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	for i := 0; i < 5; i++ {
		e.node(name("n", i), 200, 200)
	}
	net := &impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.20.0.0/22"}}
	e.create(net)
	e.startAgent(nil)
	stop := e.startOperator()

	// A watcher samples the live VMs' addresses throughout.
	var dupes atomic.Int64
	watchCtx, stopWatch := context.WithCancel(ctx)
	watched := make(chan struct{})
	t.Cleanup(func() { stopWatch(); <-watched })
	go func() {
		defer close(watched)
		for watchCtx.Err() == nil {
			holder := map[string]types.UID{}
			for _, vm := range e.list() {
				if vm.Status.IP == "" {
					continue
				}
				if other, ok := holder[vm.Status.IP]; ok && other != vm.UID {
					dupes.Add(1)
					t.Errorf("address %s held by two VMs", vm.Status.IP)
				}
				holder[vm.Status.IP] = vm.UID
			}
		}
	}()

	const total = 500
	var created atomic.Int64
	restarts := make(chan struct{})
	go func() {
		defer close(restarts)
		for _, at := range []int64{total / 3, 2 * total / 3} {
			eventually(t, created.Load).Should(BeNumerically(">=", at))
			stop()
			t.Logf("operator stopped after %d creations", created.Load())
			stop = e.startOperator()
		}
	}()
	parallel(total, 16, func(i int) {
		vm := e.vm(name("vm", i), 1, "128Mi")
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
		if err := e.c.Create(ctx, vm); err != nil {
			t.Errorf("creating: %v", err)
			return
		}
		created.Add(1)
		if i%2 == 1 { // every other VM is deleted right away, mid-flight
			if err := e.c.Delete(ctx, vm); err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("deleting: %v", err)
			}
		}
	})
	<-restarts

	// Quiescent: the survivors hold distinct addresses, one claim each.
	eventually(t, func() int { return len(e.list()) }).Should(Equal(total / 2))
	eventually(t, func() int {
		n := 0
		for _, vm := range e.list() {
			if vm.Status.IP != "" {
				n++
			}
		}
		return n
	}).Should(Equal(total / 2))
	claims := func() int {
		var l impv1.ImpIPAddressList
		if err := e.c.List(ctx, &l, client.InNamespace(e.ns)); err != nil {
			t.Error(err)
		}
		return len(l.Items)
	}
	eventually(t, claims).Should(Equal(total / 2))
	eventually(t, func() int32 {
		n := &impv1.ImpNetwork{}
		_ = e.c.Get(ctx, client.ObjectKeyFromObject(net), n)
		return n.Status.Allocated
	}).Should(Equal(int32(total / 2)))

	// Everything deleted: nothing left behind.
	parallel(total, 16, func(i int) {
		_ = e.c.Delete(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name("vm", i)}})
	})
	eventually(t, func() int { return len(e.list()) }).Should(BeZero())
	eventually(t, claims).Should(BeZero())
	eventually(t, func() int32 {
		n := &impv1.ImpNetwork{}
		_ = e.c.Get(ctx, client.ObjectKeyFromObject(net), n)
		return n.Status.Allocated + n.Status.Free
	}).Should(Equal(int32(1021)))
	if dupes.Load() > 0 {
		t.Errorf("%d duplicate address sightings", dupes.Load())
	}
}

// TestUnfitNodesGetNoVMs: cordoned, NotReady and pressured nodes, and nodes not opted in,
// receive nothing; a node that recovers does.
func TestUnfitNodesGetNoVMs(t *testing.T) {
	e := newEnv(t)
	cordoned := e.node("cordoned", 8, 8, func(n *corev1.Node) { n.Spec.Unschedulable = true })
	e.node("pressure", 8, 8, withCondition(corev1.NodeMemoryPressure, corev1.ConditionTrue))
	e.node("disk", 8, 8, withCondition(corev1.NodeDiskPressure, corev1.ConditionTrue))
	e.node("optout", 8, 8, func(n *corev1.Node) { n.Labels[impv1.NodeEnabledLabel] = "false" })
	e.node("tainted", 8, 8, func(n *corev1.Node) {
		n.Spec.Taints = []corev1.Taint{{Key: "dedicated", Value: "db", Effect: corev1.TaintEffectNoSchedule}}
	})
	e.startOperator()
	e.create(e.vm("a", 1, "256Mi"))
	eventually(t, func() string { return scheduled(e.get("a")) }).Should(Equal(impv1.ReasonNoNodeAvailable))
	msg := condition(e.get("a"), impv1.ScheduledCondition).Message
	for _, want := range []string{"0/", "1 are unschedulable", "1 have MemoryPressure", "1 have DiskPressure", "1 have a taint the VM does not tolerate", "do not match the VM's node selector"} {
		if !strings.Contains(msg, want) {
			t.Errorf("Scheduled message %q lacks %q", msg, want)
		}
	}
	eventually(t, e.events).Should(HaveKey("Unschedulable"))

	// Uncordoning the node lets the waiting VM in, without any change to the VM.
	orig := cordoned.DeepCopy()
	cordoned.Spec.Unschedulable = false
	if err := e.c.Patch(context.Background(), cordoned, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("a").Status.NodeName }).Should(Equal(cordoned.Name))

	// A VM tolerating the taint may go to the tainted node; the pressured one still gets none.
	b := e.vm("b", 1, "256Mi")
	b.Spec.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpEqual, Value: "db", Effect: corev1.TaintEffectNoSchedule}}
	b.Spec.NodeSelector["imp.test/only"] = "tainted"
	e.create(b)
	eventually(t, func() string { return scheduled(e.get("b")) }).Should(Equal(impv1.ReasonNoNodeAvailable))
	tainted := &corev1.Node{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Name: e.ns + "-tainted"}, tainted); err != nil {
		t.Fatal(err)
	}
	orig = tainted.DeepCopy()
	tainted.Labels["imp.test/only"] = "tainted"
	if err := e.c.Patch(context.Background(), tainted, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("b").Status.NodeName }).Should(Equal(tainted.Name))
}

// TestMissingClassAndNetworkRecover: a VM naming a class or network that does not exist says
// so, and is placed once they are created.
func TestMissingClassAndNetworkRecover(t *testing.T) {
	e := newEnv(t)
	e.node("n", 8, 8)
	e.startOperator()
	className := e.ns + "-small"
	vm := e.vm("a", 1, "256Mi")
	vm.Spec.Resources = nil
	vm.Spec.ClassRef = &impv1.ClassReference{Name: className}
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	e.create(vm)
	eventually(t, func() string { return scheduled(e.get("a")) }).Should(Equal(impv1.ReasonClassNotFound))
	if msg := condition(e.get("a"), impv1.ScheduledCondition).Message; !strings.Contains(msg, className) {
		t.Errorf("ClassNotFound message %q does not name the class", msg)
	}

	class := &impv1.ImpVMClass{ObjectMeta: metav1.ObjectMeta{Name: className}, Spec: impv1.ImpVMClassSpec{VCPUs: 2, Memory: resource.MustParse("512Mi")}}
	e.create(class)
	t.Cleanup(func() { _ = e.c.Delete(context.Background(), class) })
	eventually(t, func() string { return scheduled(e.get("a")) }).Should(Equal(impv1.ReasonNetworkNotFound))

	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.30.0.0/29"}})
	eventually(t, func() string { return scheduled(e.get("a")) }).Should(Equal("True"))
	got := e.get("a")
	if got.Status.IP != "10.30.0.2" || got.Status.Resources.VCPUs != 2 || got.Status.Resources.Memory.String() != "512Mi" {
		t.Errorf("placed with ip %s, resources %+v; want 10.30.0.2 (after the gateway), 2 vCPUs, 512Mi", got.Status.IP, got.Status.Resources)
	}
	ev := e.events()
	for _, r := range []string{"Unschedulable", "Scheduled"} {
		if ev[r] == 0 {
			t.Errorf("no %s Event; events: %v", r, ev)
		}
	}
}

// TestReservedCIDR: a network overlapping a range the cluster reserves is Ready=False naming
// the range, and its VMs are not placed; a network beside the range serves its VM.
func TestReservedCIDR(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.opts.VM.ReservedCIDRs = []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12")}
	e.node("n", 8, 8)
	e.startAgent(nil)
	e.startOperator()
	e.create(
		&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "services"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.100.0.0/24"}},
		&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "fine"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.112.0.0/24"}},
	)
	for name, net := range map[string]string{"on-reserved": "services", "beside": "fine"} {
		vm := e.vm(name, 1, "256Mi")
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: net}
		e.create(vm)
	}
	ready := func(name string) func() string {
		return func() string {
			n := &impv1.ImpNetwork{}
			_ = e.c.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: name}, n)
			if c := findCond(n.Status.Conditions, impv1.NetworkReadyCondition); c != nil {
				return c.Reason + ": " + c.Message
			}
			return ""
		}
	}
	eventually(t, ready("services")).Should(HavePrefix(impv1.ReasonReservedCIDR + ": cidr 10.100.0.0/24 overlaps 10.96.0.0/12"))
	eventually(t, ready("fine")).Should(HavePrefix(impv1.ReasonNetworkValid))
	eventually(t, func() string { return scheduled(e.get("on-reserved")) }).Should(Equal(impv1.ReasonReservedCIDR))
	eventually(t, func() string { return scheduled(e.get("beside")) }).Should(Equal("True"))
	if ip := e.get("on-reserved").Status.IP; ip != "" {
		t.Errorf("a VM on a reserved network holds address %s", ip)
	}
}

// TestNetworkExhaustion: a full network is a condition and an Event; a freed address is reused.
func TestNetworkExhaustion(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.node("n", 8, 8)
	e.startAgent(nil)
	e.startOperator()
	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "tiny"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.40.0.0/30"}})
	for _, n := range []string{"a", "b"} {
		vm := e.vm(n, 1, "256Mi")
		vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "tiny"}
		e.create(vm)
		if n == "a" {
			eventually(t, func() string { return e.get("a").Status.IP }).Should(Equal("10.40.0.2"))
		}
	}
	eventually(t, func() string { return scheduled(e.get("b")) }).Should(Equal(impv1.ReasonNetworkExhausted))
	eventually(t, func() string {
		n := &impv1.ImpNetwork{}
		_ = e.c.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: "tiny"}, n)
		if c := findCond(n.Status.Conditions, impv1.NetworkReadyCondition); c != nil {
			return c.Reason
		}
		return ""
	}).Should(Equal(impv1.ReasonAddressesExhausted))

	if err := e.c.Delete(ctx, e.get("a")); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("b").Status.IP }).Should(Equal("10.40.0.2"))
}

func findCond(cs []metav1.Condition, t string) *metav1.Condition {
	for i := range cs {
		if cs[i].Type == t {
			return &cs[i]
		}
	}
	return nil
}

// TestRunStrategies drives each runStrategy through a workload exit reported by the agent.
func TestRunStrategies(t *testing.T) {
	e := newEnv(t)
	e.node("n", 16, 16)
	codes := map[string]int32{"always": 0, "rerun-ok": 0, "rerun-fail": 3, "once-fail": 1}
	e.startAgent(func(vm *impv1.ImpVM) *int32 {
		c, ok := codes[vm.Name]
		if !ok {
			return nil
		}
		return &c
	})
	e.startOperator()
	for n, s := range map[string]impv1.RunStrategy{
		"always": impv1.RunStrategyAlways, "rerun-ok": impv1.RunStrategyRerunOnFailure,
		"rerun-fail": impv1.RunStrategyRerunOnFailure, "once-fail": impv1.RunStrategyOnce, "halt": impv1.RunStrategyAlways,
	} {
		vm := e.vm(n, 1, "256Mi")
		vm.Spec.RunStrategy = s
		e.create(vm)
	}
	phase := func(n string) func() impv1.VMPhase { return func() impv1.VMPhase { return e.get(n).Status.Phase } }
	restarts := func(n string) func() int32 { return func() int32 { return e.get(n).Status.RestartCount } }

	eventually(t, restarts("always")).Should(BeNumerically(">=", 3))
	eventually(t, restarts("rerun-fail")).Should(BeNumerically(">=", 2))
	eventually(t, phase("rerun-ok")).Should(Equal(impv1.VMSucceeded))
	eventually(t, phase("once-fail")).Should(Equal(impv1.VMFailed))
	eventually(t, phase("halt")).Should(Equal(impv1.VMRunning))
	if c := condition(e.get("halt"), impv1.ReadyCondition); c == nil || c.Status != metav1.ConditionTrue || c.Reason != impv1.ReasonGuestReady {
		t.Errorf("running VM's Ready condition: %+v", c)
	}
	if e.get("rerun-ok").Status.RestartCount != 0 || e.get("once-fail").Status.RestartCount != 0 {
		t.Error("a VM that must not restart was restarted")
	}

	// Halting a running VM stops it and keeps it stopped.
	halt := e.get("halt")
	orig := halt.DeepCopy()
	halt.Spec.RunStrategy = impv1.RunStrategyHalted
	if err := e.c.Patch(context.Background(), halt, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	eventually(t, phase("halt")).Should(Equal(impv1.VMStopped))
	if c := condition(e.get("halt"), impv1.ReadyCondition); c.Reason != impv1.ReasonHalted {
		t.Errorf("halted VM's Ready reason %q", c.Reason)
	}
	// Events are recorded apart from the status (the recorder's queue): they arrive after it.
	eventually(t, func() error {
		ev := e.events()
		for _, r := range []string{"Scheduled", "Started", "Restarting", "Succeeded", "Failed", "Stopped"} {
			if ev[r] == 0 {
				return fmt.Errorf("no %s Event; events: %v", r, ev)
			}
		}
		return nil
	}).Should(Succeed())
}

// TestBackoffGrows: restart delays double and show in status.
func TestBackoffGrows(t *testing.T) {
	e := newEnv(t)
	e.opts.VM.RestartBackoffBase = 300 * time.Millisecond
	e.opts.VM.RestartBackoffMax = 10 * time.Second
	e.node("n", 4, 4)
	e.startAgent(func(*impv1.ImpVM) *int32 { return ptr.To[int32](1) })
	e.startOperator()
	e.create(e.vm("crash", 1, "256Mi"))
	// Restart k waits 300ms·2^(k-1): the 4th restart comes after 300+600+1200 ms of waiting;
	// status shows the pending restart with its reason.
	eventually(t, func() string {
		vm := e.get("crash")
		if vm.Status.NextRestartAt == nil {
			return ""
		}
		return condition(vm, impv1.ReadyCondition).Reason
	}).Should(Equal(impv1.ReasonBackoff))
	eventually(t, func() int32 { return e.get("crash").Status.RestartCount }).Should(BeNumerically(">=", 4))
}

// heartbeat keeps node's simulated agent beating, as the agent does (its Lease), until the
// returned function is called.
func (e *env) heartbeat(node string) (stop func()) {
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		var lease *coordinationv1.Lease
		for {
			if l, err := nodereport.RenewHeartbeat(context.Background(), e.c, e.c, runsecret.DefaultNamespace, node, 200*time.Millisecond, lease); err == nil {
				lease = l
			}
			select {
			case <-done:
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	var once sync.Once
	stop = func() { once.Do(func() { close(done); <-stopped }) }
	e.t.Cleanup(stop)
	return stop
}

// TestNodeLost: a VM stays on a node whose kubelet is NotReady while its agent reports; with
// the agent silent too it is reported NodeUnreachable but still not started elsewhere (it may
// run there); once the node is fenced (tainted out of service) it is placed again as a new
// instance (Always) or fails (Once).
func TestNodeLost(t *testing.T) {
	e := newEnv(t)
	e.opts.VM.AgentHeartbeatTimeout = 2 * time.Second
	ctx := context.Background()
	doomed := e.node("doomed", 4, 4)
	stopBeats := e.heartbeat(doomed.Name)
	e.startAgent(nil)
	e.startOperator()
	again, once := e.vm("again", 1, "256Mi"), e.vm("once", 1, "256Mi")
	once.Spec.RunStrategy = impv1.RunStrategyOnce
	e.create(again, once)
	for _, n := range []string{"again", "once"} {
		eventually(t, func() impv1.VMPhase { return e.get(n).Status.Phase }).Should(Equal(impv1.VMRunning))
	}
	spare := e.node("spare", 4, 4)
	e.heartbeat(spare.Name)

	// The kubelet NotReady, the agent still reporting: well past the grace period, nothing moves.
	orig := doomed.DeepCopy()
	doomed.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionFalse, Reason: "KubeletStopped", LastTransitionTime: metav1.Now()}}
	if err := e.c.Status().Patch(ctx, doomed, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	consistently(t, func() string {
		v := e.get("again")
		return v.Status.NodeName + " " + condition(v, impv1.ReadyCondition).Reason
	}, 3*e.opts.VM.NodeLostGracePeriod).Should(Equal(doomed.Name + " " + impv1.ReasonGuestReady))

	// The agent silent too: unreachable, reported, and still not started elsewhere.
	stopBeats()
	eventually(t, func() string {
		if c := condition(e.get("again"), impv1.ReadyCondition); c != nil {
			return c.Reason
		}
		return ""
	}).Should(Equal(impv1.ReasonNodeUnreachable))
	eventually(t, e.events).Should(HaveKey(impv1.ReasonNodeUnreachable))
	consistently(t, func() string { return e.get("again").Status.NodeName + " " + e.get("once").Status.NodeName }, 2*time.Second).
		Should(Equal(doomed.Name + " " + doomed.Name))
	if msg := condition(e.get("again"), impv1.ReadyCondition).Message; !strings.Contains(msg, corev1.TaintNodeOutOfService) {
		t.Errorf("NodeUnreachable message %q does not say how to fence the node", msg)
	}

	// Fenced: the VMs leave it.
	if err := e.c.Get(ctx, client.ObjectKeyFromObject(doomed), doomed); err != nil {
		t.Fatal(err)
	}
	doomed.Spec.Taints = append(doomed.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute})
	if err := e.c.Update(ctx, doomed); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() string { return e.get("again").Status.NodeName }).Should(Equal(spare.Name))
	got := e.get("again")
	if got.Status.Instance != 2 {
		t.Errorf("re-placed VM has instance %d, want 2", got.Status.Instance)
	}
	eventually(t, func() impv1.VMPhase { return e.get("again").Status.Phase }).Should(Equal(impv1.VMRunning))
	eventually(t, func() impv1.VMPhase { return e.get("once").Status.Phase }).Should(Equal(impv1.VMFailed))
	if c := condition(e.get("once"), impv1.ReadyCondition); c.Reason != impv1.ReasonNodeLost {
		t.Errorf("lost Once VM's Ready reason %q, want NodeLost", c.Reason)
	}
	eventually(t, e.events).Should(HaveKey("NodeLost"))
}

// TestSilentAgentTakesNoVMs: a node whose agent stopped reporting gets no VM, and the VM says
// why; when the agent reports again, the VM is placed there.
func TestSilentAgentTakesNoVMs(t *testing.T) {
	e := newEnv(t)
	e.opts.VM.AgentHeartbeatTimeout = 2 * time.Second
	quiet := e.node("quiet", 4, 4)
	rep := &impv1.ImpNode{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Name: quiet.Name}, rep); err != nil {
		t.Fatal(err)
	}
	orig := rep.DeepCopy()
	last := metav1.NewTime(time.Now().Add(-time.Minute))
	rep.Status.HeartbeatTime = &last
	if err := e.c.Status().Patch(context.Background(), rep, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	e.startAgent(nil)
	e.startOperator()
	e.create(e.vm("waits", 1, "256Mi"))
	eventually(t, func() string {
		if c := condition(e.get("waits"), impv1.ScheduledCondition); c != nil {
			return c.Message
		}
		return ""
	}).Should(ContainSubstring("1 have an IMP agent that stopped reporting"))
	if n := e.get("waits").Status.NodeName; n != "" {
		t.Fatalf("placed on %s, whose agent is silent", n)
	}
	e.heartbeat(quiet.Name)
	eventually(t, func() string { return e.get("waits").Status.NodeName }).Should(Equal(quiet.Name))
}

// TestDeletionWaitsForTheAgent: the finalizer holds the VM until the node's agent reports it
// gone; an address is released only then.
func TestDeletionWaitsForTheAgent(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.node("n", 4, 4)
	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.50.0.0/24"}})
	e.startOperator()
	vm := e.vm("a", 1, "256Mi")
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	e.create(vm)
	eventually(t, func() string { return e.get("a").Status.IP }).ShouldNot(BeEmpty())
	if err := e.c.Delete(ctx, e.get("a")); err != nil {
		t.Fatal(err)
	}
	// No agent: the VM stays, Stopping, its address held.
	eventually(t, func() impv1.VMPhase { return e.get("a").Status.Phase }).Should(Equal(impv1.VMStopping))
	NewWithT(t).Consistently(func() *impv1.ImpVM { return e.get("a") }).WithTimeout(2 * time.Second).Should(Not(BeNil()))
	var claims impv1.ImpIPAddressList
	if err := e.c.List(ctx, &claims, client.InNamespace(e.ns)); err != nil || len(claims.Items) != 1 {
		t.Errorf("address claims while waiting: %d, %v", len(claims.Items), err)
	}
	e.startAgent(nil)
	eventually(t, func() *impv1.ImpVM { return e.get("a") }).Should(BeNil())
	eventually(t, func() int {
		_ = e.c.List(ctx, &claims, client.InNamespace(e.ns))
		return len(claims.Items)
	}).Should(BeZero())
}

// TestExpireAfter deletes a VM once it has existed for expireAfter.
func TestExpireAfter(t *testing.T) {
	e := newEnv(t)
	e.node("n", 4, 4)
	e.startAgent(nil)
	e.startOperator()
	vm := e.vm("short", 1, "256Mi")
	vm.Spec.ExpireAfter = &metav1.Duration{Duration: 2 * time.Second}
	e.create(vm)
	eventually(t, func() *impv1.ImpVM { return e.get("short") }).Should(BeNil())
	eventually(t, e.events).Should(HaveKey("Expired"))
}

// TestForcedDeletionFreesTheNode: a VM deleted with its finalizer stripped by hand never passes
// through the operator's deletion; what it held on its node is freed all the same.
func TestForcedDeletionFreesTheNode(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.node("n", 1, 1)
	e.startOperator()
	e.create(e.vm("a", 1, "1Gi"))
	eventually(t, func() string { return scheduled(e.get("a")) }).Should(Equal("True"))
	e.create(e.vm("b", 1, "1Gi"))
	eventually(t, func() string { return scheduled(e.get("b")) }).Should(Equal(impv1.ReasonNoNodeAvailable))

	if err := e.c.Delete(ctx, e.get("a")); err != nil {
		t.Fatal(err)
	}
	if err := e.c.Patch(ctx, e.get("a"), client.RawPatch(types.MergePatchType, []byte(`{"metadata":{"finalizers":null}}`))); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() *impv1.ImpVM { return e.get("a") }).Should(BeNil())
	eventually(t, func() string { return scheduled(e.get("b")) }).Should(Equal("True"))
}

// TestNetworkVNIsAndNodeReports: every network gets its own overlay VNI, and a node's report of
// a network it failed to plumb becomes the network's NodesReady condition, naming the node.
func TestNetworkVNIsAndNodeReports(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.node("n", 8, 8)
	e.startOperator()
	const count = 12
	for i := 0; i < count; i++ {
		e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name("net", i)},
			Spec: impv1.ImpNetworkSpec{CIDR: fmt.Sprintf("10.%d.0.0/24", 100+i)}})
	}
	eventually(t, func() error {
		var nets impv1.ImpNetworkList
		if err := e.c.List(ctx, &nets, client.InNamespace(e.ns)); err != nil {
			return err
		}
		seen := map[int32]string{}
		for _, n := range nets.Items {
			if n.Status.VNI == 0 {
				return fmt.Errorf("%s has no VNI", n.Name)
			}
			if other, ok := seen[n.Status.VNI]; ok {
				t.Fatalf("%s and %s share VNI %d", n.Name, other, n.Status.VNI)
			}
			seen[n.Status.VNI] = n.Name
		}
		if len(seen) != count {
			return fmt.Errorf("%d networks", len(seen))
		}
		return nil
	}).Should(Succeed())

	rep := &impv1.ImpNode{}
	if err := e.c.Get(ctx, client.ObjectKey{Name: e.ns + "-n"}, rep); err != nil {
		t.Fatal(err)
	}
	rep.Status.Networks = []impv1.NodeNetwork{{Namespace: e.ns, Name: name("net", 0), Message: "creating VXLAN device: address already in use"}}
	if err := e.c.Status().Update(ctx, rep); err != nil {
		t.Fatal(err)
	}
	nodesReady := func() string {
		var n impv1.ImpNetwork
		if err := e.c.Get(ctx, client.ObjectKey{Namespace: e.ns, Name: name("net", 0)}, &n); err != nil {
			return err.Error()
		}
		c := meta.FindStatusCondition(n.Status.Conditions, impv1.NetworkNodesReadyCondition)
		if c == nil {
			return "no condition"
		}
		return string(c.Status) + " " + c.Reason + " " + c.Message
	}
	eventually(t, nodesReady).Should(Equal("False NodeNetworkFailed 1 of 1 nodes failed: " + e.ns + "-n: creating VXLAN device: address already in use"))
	rep.Status.Networks[0].Ready, rep.Status.Networks[0].Message = true, ""
	if err := e.c.Status().Update(ctx, rep); err != nil {
		t.Fatal(err)
	}
	eventually(t, nodesReady).Should(Equal("True NodesReady plumbed on 1 nodes"))
}

// TestDeletionOutlastsItsTimeout: a deleted VM whose agent never confirms its VMM is gone keeps
// its address and place past the deletion timeout, which only warns, until its node is fenced.
func TestDeletionOutlastsItsTimeout(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.opts.VM.DeletionTimeout = time.Second
	node := e.node("mute", 4, 4)
	e.startOperator()
	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.50.0.0/29"}})
	vm := e.vm("held", 1, "256Mi")
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	e.create(vm)
	eventually(t, func() string { return e.get("held").Status.IP }).Should(Equal("10.50.0.2"))
	if err := e.c.Delete(ctx, e.get("held")); err != nil {
		t.Fatal(err)
	}
	eventually(t, e.events).Should(HaveKey("DeletionTimeout"))
	claims := func() int {
		var l impv1.ImpIPAddressList
		_ = e.c.List(ctx, &l, client.InNamespace(e.ns))
		return len(l.Items)
	}
	consistently(t, func() string {
		v := e.get("held")
		if v == nil {
			return "released"
		}
		return fmt.Sprintf("%s %s %d", v.Status.Phase, v.Status.NodeName, claims())
	}, 4*e.opts.VM.DeletionTimeout).Should(Equal(fmt.Sprintf("%s %s 1", impv1.VMStopping, node.Name)))

	if err := e.c.Get(ctx, client.ObjectKeyFromObject(node), node); err != nil {
		t.Fatal(err)
	}
	node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute})
	if err := e.c.Update(ctx, node); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() bool { return e.get("held") == nil }).Should(BeTrue())
	eventually(t, claims).Should(Equal(0))
}

// TestAddressesCarryTheVMsLabels: a VM's address carries its labels and named ports from its
// placement on, and follows them when they change: each node's NetworkPolicies select VM peers
// from the addresses alone.
func TestAddressesCarryTheVMsLabels(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.node("n", 8, 8)
	e.create(&impv1.ImpNetwork{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "net"}, Spec: impv1.ImpNetworkSpec{CIDR: "10.40.0.0/24"}})
	e.startOperator()
	vm := e.vm("web", 1, "256Mi")
	vm.Labels = map[string]string{"app": "web"}
	vm.Spec.NetworkRef = &impv1.NetworkReference{Name: "net"}
	vm.Spec.Ports = []impv1.VMPort{{Name: "http", Port: 8080}, {Port: 9090}}
	e.create(vm)
	address := func() impv1.ImpIPAddressSpec {
		var list impv1.ImpIPAddressList
		if err := e.c.List(ctx, &list, client.InNamespace(e.ns)); err != nil || len(list.Items) != 1 {
			return impv1.ImpIPAddressSpec{}
		}
		return list.Items[0].Spec
	}
	eventually(t, func() map[string]string { return address().VMLabels }).Should(Equal(map[string]string{"app": "web"}))
	if got := address().VMPorts; len(got) != 1 || got[0].Name != "http" || got[0].Port != 8080 {
		t.Errorf("the address's ports: %+v, want http 8080 alone", got)
	}
	cur := e.get("web")
	cur.Labels = map[string]string{"app": "web", "tier": "front"}
	if err := e.c.Update(ctx, cur); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() map[string]string { return address().VMLabels }).Should(Equal(map[string]string{"app": "web", "tier": "front"}))
	cur = e.get("web")
	cur.Labels = nil
	if err := e.c.Update(ctx, cur); err != nil {
		t.Fatal(err)
	}
	eventually(t, func() map[string]string { return address().VMLabels }).Should(BeEmpty())
}
