package impvmmigration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	crmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/controller/impvmmigration"
	"github.com/syscode-labs/imp/internal/failpoint"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

// env is one test's world: its namespace, nodes only its VMs go to (a label of its own), the
// operator, and a double of each node's agent that runs the VMs placed on it at once.
type env struct {
	t   *testing.T
	cl  *testcluster.Cluster
	c   client.Client
	ns  string
	sfx string
}

func newEnv(t *testing.T) *env { return newEnvWith(t, nil) }

// newEnvWith is newEnv with the operator's options changed by set.
func newEnvWith(t *testing.T, set func(*operator.Options)) *env {
	e := newEnvNoOperator(t)
	opts := operator.Options{VM: impvm.DefaultOptions(), Concurrency: 2}
	opts.VM.AgentHeartbeatTimeout = time.Hour // the doubles beat no Lease
	if set != nil {
		set(&opts)
	}
	mgr, err := ctrl.NewManager(e.cl.As(t, testcluster.Operator), ctrl.Options{Scheme: e.cl.Scheme, Metrics: metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0", Controller: config.Controller{SkipNameValidation: ptr.To(true)}, Cache: operator.CacheOptions(opts)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if err := operator.Setup(ctx, mgr, opts); err != nil {
		t.Fatal(err)
	}
	testcluster.RunManager(t, mgr)
	return e
}

// newEnvNoOperator is the test's cluster, namespace and agent doubles, with no operator.
func newEnvNoOperator(t *testing.T) *env {
	cl := testcluster.Require(t, shared)
	// The agents' writes go through the chart's admission policy, as in a cluster.
	cl.InstallChartObjects(t, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
	ns := cl.Namespace(t)
	e := &env{t: t, cl: cl, c: cl.Client, ns: ns, sfx: ns[len(ns)-5:]}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e.runVMs(ctx)
	return e
}

// startOperatorProcess runs the imp-operator binary against the test's cluster, with env added
// to its environment (a failpoint); the channel closes when it has ended, with its exit code.
func (e *env) startOperatorProcess(env ...string) <-chan int {
	e.t.Helper()
	cmd := exec.Command(testcluster.Binary(e.t, "github.com/syscode-labs/imp/cmd/imp-operator"), "--kubeconfig", e.cl.KubeconfigAs(e.t, testcluster.Operator), "--leader-elect=false",
		"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--log-level", "error", "--agent-heartbeat-timeout", "1h")
	cmd.Stderr = os.Stderr
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	exited, done := make(chan int, 1), make(chan struct{})
	go func() { _ = cmd.Wait(); exited <- cmd.ProcessState.ExitCode(); close(done) }()
	e.t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
	return exited
}

// node makes a Ready node of the test's with an agent report of 4 vCPUs and memGi, taking
// migrations with the kernel all the test's nodes have, and returns its name.
func (e *env) node(name string, memGi int64) string {
	return e.nodeWith(name, memGi, "127.0.0.1:10261", "k1")
}

// nodeWith is node with the agent's migration endpoint and kernel hash as given ("": none),
// its report changed by each of set.
func (e *env) nodeWith(name string, memGi int64, endpoint, kernel string, set ...func(*impv1.ImpNodeStatus)) string {
	e.t.Helper()
	ctx := context.Background()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "mig-" + name + "-" + e.sfx, Labels: map[string]string{impv1.NodeEnabledLabel: "true", "imp.test/pool": e.ns}}}
	if err := e.c.Create(ctx, n); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.c.Delete(context.Background(), n) })
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()}}
	if err := e.c.Status().Update(ctx, n); err != nil {
		e.t.Fatal(err)
	}
	rep := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: n.Name}}
	if err := e.c.Create(ctx, rep); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.c.Delete(context.Background(), rep) })
	rep.Status = impv1.ImpNodeStatus{
		Allocatable:       &impv1.NodeResources{VCPUs: 4, Memory: *resource.NewQuantity(memGi<<30, resource.BinarySI)},
		VMMs:              []impv1.VMMCapability{{Kind: impv1.VMMQEMU, Acceleration: "tcg"}},
		Conditions:        []metav1.Condition{{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonAgentReady, LastTransitionTime: metav1.Now()}},
		MigrationEndpoint: endpoint,
		Kernel:            &impv1.Artifact{Path: "/boot/vmlinuz", SHA256: kernel},
	}
	for _, f := range set {
		f(&rep.Status)
	}
	if err := e.c.Status().Update(ctx, rep); err != nil {
		e.t.Fatal(err)
	}
	return n.Name
}

// runVMs is every node's agent double for runs: a VM of the test's placed on a node is
// reported running with its guest ready, once per run.
func (e *env) runVMs(ctx context.Context) {
	go func() {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for ctx.Err() == nil {
			<-tick.C
			var l impv1.ImpVMList
			if err := e.c.List(ctx, &l, client.InNamespace(e.ns)); err != nil {
				continue
			}
			for i := range l.Items {
				vm := &l.Items[i]
				st, rt := &vm.Status, vm.Status.Runtime
				current := rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount
				now := metav1.Now()
				next := impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount, State: impv1.RuntimeRunning, StartedAt: &now, GuestReady: true}
				switch {
				case st.NodeName == "" || st.Instance == 0 || !vm.DeletionTimestamp.IsZero():
					continue
				case vm.Spec.RunStrategy == impv1.RunStrategyHalted:
					if current && rt.State == impv1.RuntimeStopped {
						continue
					}
					next = impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount, State: impv1.RuntimeStopped, FinishedAt: &now}
				case current:
					continue
				}
				p, _ := json.Marshal(map[string]any{"status": map[string]any{"runtime": next}})
				_ = e.c.Status().Patch(ctx, vm, client.RawPatch(types.MergePatchType, p))
			}
		}
	}()
}

// running makes a VM of 1 vCPU and mem and waits until it runs; it returns it as it is then.
func (e *env) running(name, mem string) *impv1.ImpVM {
	e.t.Helper()
	vm := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}, Spec: impv1.ImpVMSpec{Image: "registry.test/app:1",
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse(mem))}, NodeSelector: map[string]string{"imp.test/pool": e.ns}}}
	if err := e.c.Create(context.Background(), vm); err != nil {
		e.t.Fatal(err)
	}
	NewWithT(e.t).Eventually(func() bool {
		vm = e.vm(name)
		rt := vm.Status.Runtime
		return vm.Status.Phase == impv1.VMRunning && rt != nil && rt.GuestReady
	}).WithTimeout(time.Minute).WithPolling(50*time.Millisecond).Should(BeTrue(), "VM "+name+" never ran")
	return vm
}

func (e *env) vm(name string) *impv1.ImpVM {
	vm := &impv1.ImpVM{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, vm); err != nil {
		e.t.Fatal(err)
	}
	return vm
}

func (e *env) migrate(name, vm, target string, timeout *int32) *impv1.ImpVMMigration {
	e.t.Helper()
	m := &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: impv1.ImpVMMigrationSpec{VMName: vm, TargetNode: target, TimeoutSeconds: timeout}}
	if err := e.c.Create(context.Background(), m); err != nil {
		e.t.Fatal(err)
	}
	return m
}

func (e *env) migration(name string) *impv1.ImpVMMigration {
	m := &impv1.ImpVMMigration{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, m); err != nil {
		e.t.Fatal(err)
	}
	return m
}

// phase waits until migration name is in phase p and returns it then.
func (e *env) phase(name string, p impv1.MigrationPhase) *impv1.ImpVMMigration {
	e.t.Helper()
	var m *impv1.ImpVMMigration
	NewWithT(e.t).Eventually(func() impv1.MigrationPhase {
		m = e.migration(name)
		return m.Status.Phase
	}).WithTimeout(time.Minute).WithPolling(50*time.Millisecond).Should(Equal(p), func() string {
		b, _ := json.MarshalIndent(m.Status, "", " ")
		return "migration " + name + ": " + string(b)
	})
	return m
}

// agent is the client of node's agent (its identity, bound to the node).
func (e *env) agent(node string) client.Client {
	e.t.Helper()
	c, err := client.New(e.cl.AsNode(e.t, testcluster.Agent, node), client.Options{Scheme: e.cl.Scheme})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

// report writes side ("source" or "target") of migration name with agent a.
func (e *env) report(a client.Client, name, side string, r impv1.MigrationAgentReport) error {
	p, _ := json.Marshal(map[string]any{"status": map[string]any{side: r}})
	return a.Status().Patch(context.Background(), &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}},
		client.RawPatch(types.MergePatchType, p))
}

func refused(err error) bool { return apierrors.IsForbidden(err) || apierrors.IsInvalid(err) }

// TestAMigrationMovesTheVMOnce: a migration of a running VM with no target chosen gets the other
// node; the VM is the migration's (its status says so) and the source may send only once the
// target reports its place ready; the commit moves the VM's nodeName to the target only once
// the target has the whole state and the source's guest is paused, with the source's downtime
// and bytes; once the target runs it, the migration has succeeded and the VM is let go. A second
// migration of the VM meanwhile fails without touching it. Each agent writes its own side
// alone: the source cannot say the target loaded, the target cannot commit, a third node's
// agent cannot write either side.
func TestAMigrationMovesTheVMOnce(t *testing.T) {
	e := newEnv(t)
	a, b, c := e.node("a", 8), e.node("b", 8), e.node("c", 1)
	vm := e.running("vm", "2Gi") // c cannot hold it
	source, target := vm.Status.NodeName, a
	if source == a {
		target = b
	}
	ctx := context.Background()
	before := gathered(t)
	e.migrate("move", "vm", "", nil)
	m := e.phase("move", impv1.MigrationPreparing)
	if m.Status.SourceNode != source || m.Status.TargetNode != target || m.Status.VMUID != vm.UID || m.Status.StartedAt == nil {
		t.Fatalf("preparing: %+v; want from %s to %s", m.Status, source, target)
	}
	if got := e.vm("vm").Status.Migration; got == nil || got.UID != m.UID || got.Phase != impv1.MigrationPreparing || got.TargetNode != target {
		t.Errorf("the VM's status.migration while preparing: %+v", got)
	}
	if !controllerHasFinalizer(m) {
		t.Errorf("no finalizer on the migration: %v", m.Finalizers)
	}

	// A second migration of the VM fails; the first goes on.
	e.migrate("again", "vm", "", nil)
	if f := e.phase("again", impv1.MigrationFailed); f.Status.Reason != impvmmigration.ReasonBusy {
		t.Errorf("a second migration: %s %q; want %s", f.Status.Reason, f.Status.Message, impvmmigration.ReasonBusy)
	}

	src, tgt, third := e.agent(source), e.agent(target), e.agent(c)
	// The policy takes a moment to be in force: waited for on a write of the third node's that
	// changes nothing.
	NewWithT(t).Eventually(func() error {
		return third.Status().Patch(ctx, &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "move"}}, client.RawPatch(types.MergePatchType, []byte(`{"status":{}}`)))
	}).WithTimeout(time.Minute).WithPolling(200*time.Millisecond).Should(Satisfy(refused), "the admission policy never refused an unrelated node's agent")
	for _, bad := range []struct {
		who   string
		as    client.Client
		patch string
	}{
		{"the source, the target's side", src, `{"status":{"target":{"state":"Loaded"}}}`},
		{"the target, the source's side", tgt, `{"status":{"source":{"state":"Paused"}}}`},
		{"the target, the phase", tgt, `{"status":{"phase":"Committed"}}`},
		{"the target, the target node", tgt, `{"status":{"targetNode":"` + c + `"}}`},
		{"the source, the VM's migration", src, ``},
		{"a third node, the source's side", third, `{"status":{"source":{"state":"Failed","message":"x"}}}`},
	} {
		var err error
		if bad.patch == "" { // the VM's status.migration is the operator's alone
			err = bad.as.Status().Patch(ctx, &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "vm"}}, client.RawPatch(types.MergePatchType,
				[]byte(`{"status":{"migration":{"name":"move","uid":"`+string(m.UID)+`","phase":"Committed","targetNode":"`+target+`"}}}`)))
		} else {
			err = bad.as.Status().Patch(ctx, &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "move"}}, client.RawPatch(types.MergePatchType, []byte(bad.patch)))
		}
		if !refused(err) {
			t.Errorf("%s wrote: %v", bad.who, err)
		}
	}
	if got := e.migration("move").Status; got.Phase != impv1.MigrationPreparing || got.Target != nil || got.Source != nil {
		t.Fatalf("after the refused writes: %+v", got)
	}

	// The source does not send before the target is ready.
	if err := e.report(src, "move", "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentPaused, Bytes: 1}); err != nil {
		t.Fatal(err)
	}
	if err := e.report(tgt, "move", "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentLoaded}); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Consistently(func() string { return e.vm("vm").Status.NodeName }).WithTimeout(time.Second).Should(Equal(source),
		"committed while the migration was Preparing")
	if err := e.report(tgt, "move", "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentReady}); err != nil {
		t.Fatal(err)
	}
	e.phase("move", impv1.MigrationTransferring)
	if got := e.vm("vm").Status.Migration; got == nil || got.Phase != impv1.MigrationTransferring {
		t.Errorf("the VM's status.migration while transferring: %+v", got)
	}
	// The target has it all, the source still sends: no commit.
	if err := e.report(src, "move", "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentSending, Bytes: 100 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := e.report(tgt, "move", "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentLoaded, Bytes: 100 << 20}); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() int64 { return e.migration("move").Status.BytesMoved }).WithTimeout(time.Minute).Should(Equal(int64(100 << 20)))
	if got := e.vm("vm").Status.NodeName; got != source {
		t.Fatalf("committed while the source was still sending: the VM is on %s", got)
	}
	if err := e.report(src, "move", "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentPaused, Bytes: 120 << 20,
		Downtime: &metav1.Duration{Duration: 49 * time.Millisecond}}); err != nil {
		t.Fatal(err)
	}
	m = e.phase("move", impv1.MigrationCommitted)
	moved := e.vm("vm")
	if moved.Status.NodeName != target || moved.UID != vm.UID || moved.Status.IP != vm.Status.IP || moved.Status.Instance != vm.Status.Instance {
		t.Errorf("committed: the VM is %s on %s, address %s, instance %d; want the same VM on %s", moved.UID, moved.Status.NodeName, moved.Status.IP, moved.Status.Instance, target)
	}
	if m.Status.CommittedAt == nil || m.Status.Downtime == nil || m.Status.Downtime.Duration != 49*time.Millisecond || m.Status.BytesMoved != 120<<20 {
		t.Errorf("committed: %+v", m.Status)
	}
	if err := e.report(tgt, "move", "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentRunning, Bytes: 120 << 20}); err != nil {
		t.Fatal(err)
	}
	m = e.phase("move", impv1.MigrationSucceeded)
	if m.Status.CompletedAt == nil || !isReady(m) {
		t.Errorf("succeeded: %+v", m.Status)
	}
	// Counted once, with its figures.
	after := gathered(t)
	for name, want := range map[string]float64{
		`imp_vm_migrations_total{reason="Succeeded",result="Succeeded"}`: 1,
		`imp_vm_migration_sent_bytes_total`:                              120 << 20,
		`imp_vm_migration_downtime_seconds_count`:                        1,
		`imp_vm_migration_downtime_seconds_sum`:                          0.049,
		`imp_vm_migration_duration_seconds_count{result="Succeeded"}`:    1,
	} {
		if got := after[name] - before[name]; got < want-1e-9 || got > want+1e-9 {
			t.Errorf("%s grew by %v; want %v", name, got, want)
		}
	}
	NewWithT(t).Eventually(func() *impv1.MigrationStatus { return e.vm("vm").Status.Migration }).WithTimeout(time.Minute).Should(BeNil(),
		"the VM still names its migration")
	if got := e.vm("vm"); got.Status.NodeName != target || got.Status.Phase != impv1.VMRunning {
		t.Errorf("after the migration: %s on %s", got.Status.Phase, got.Status.NodeName)
	}
}

func controllerHasFinalizer(m *impv1.ImpVMMigration) bool {
	for _, f := range m.Finalizers {
		if f == impvmmigration.Finalizer {
			return true
		}
	}
	return false
}

func isReady(m *impv1.ImpVMMigration) bool {
	for _, c := range m.Status.Conditions {
		if c.Type == impv1.ReadyCondition {
			return c.Status == metav1.ConditionTrue
		}
	}
	return false
}

// TestAMigrationThatCannotCommitLeavesTheVM: a target that fails, a migration past its timeout
// and a migration deleted before its commit each end with the VM on its source, untouched (its
// node, its run, no migration named), and the room held on the target released: a VM that
// needs all of it is placed there next.
func TestAMigrationThatCannotCommitLeavesTheVM(t *testing.T) {
	e := newEnv(t)
	a, b := e.node("a", 8), e.node("b", 8)
	vm := e.running("vm", "3Gi")
	source, target := vm.Status.NodeName, a
	if source == a {
		target = b
	}
	tgt := e.agent(target)
	ctx := context.Background()
	steady := func(why string) {
		t.Helper()
		NewWithT(t).Eventually(func() *impv1.MigrationStatus { return e.vm("vm").Status.Migration }).WithTimeout(time.Minute).Should(BeNil(), why+": the VM still names a migration")
		got := e.vm("vm")
		if got.Status.NodeName != source || got.Status.Instance != vm.Status.Instance || got.Status.RestartCount != vm.Status.RestartCount {
			t.Errorf("%s: the VM is on %s, instance %d run %d; want it as it was on %s", why, got.Status.NodeName, got.Status.Instance, got.Status.RestartCount, source)
		}
	}

	before := gathered(t)
	e.migrate("fails", "vm", target, nil)
	e.phase("fails", impv1.MigrationPreparing)
	NewWithT(t).Eventually(func() error {
		return e.report(tgt, "fails", "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentFailed, Message: "no room for the tap"})
	}).WithTimeout(time.Minute).WithPolling(200 * time.Millisecond).Should(Succeed())
	if m := e.phase("fails", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonTargetFailed || !strings.Contains(m.Status.Message, "no room for the tap") {
		t.Errorf("a failed target: %s %q", m.Status.Reason, m.Status.Message)
	}
	if got := gathered(t)[`imp_vm_migrations_total{reason="TargetFailed",result="Failed"}`] - before[`imp_vm_migrations_total{reason="TargetFailed",result="Failed"}`]; got != 1 {
		t.Errorf("a failed target counted %v times; want once", got)
	}
	steady("after a failed target")

	e.migrate("slow", "vm", target, ptr.To[int32](10))
	e.phase("slow", impv1.MigrationPreparing)
	if m := e.phase("slow", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonTimedOut {
		t.Errorf("a migration past its timeout: %s %q", m.Status.Reason, m.Status.Message)
	}
	steady("after a timeout")

	del := e.migrate("deleted", "vm", target, nil)
	e.phase("deleted", impv1.MigrationPreparing)
	if err := e.c.Delete(ctx, del); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() bool {
		return apierrors.IsNotFound(e.c.Get(ctx, client.ObjectKeyFromObject(del), &impv1.ImpVMMigration{}))
	}).WithTimeout(time.Minute).Should(BeTrue(), "the deleted migration is still there")
	steady("after the migration was deleted")

	// Nothing is held for the copies: a VM needing all but what the node keeps fits on the target.
	big := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "big"}, Spec: impv1.ImpVMSpec{Image: "registry.test/app:1", NodeName: target,
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("6Gi"))}, NodeSelector: map[string]string{"imp.test/pool": e.ns}}}
	if err := e.c.Create(ctx, big); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() string { return e.vm("big").Status.NodeName }).WithTimeout(time.Minute).Should(Equal(target),
		"the target's room is still held for a migration that ended")
}

// TestMigrationsThatCannotStart: a VM that does not exist, one that is not running (halted),
// and a target that is the VM's own node fail at once with what is wrong, and the VM is not
// touched; a target with no room waits for one, saying why, until its timeout.
func TestMigrationsThatCannotStart(t *testing.T) {
	e := newEnv(t)
	a := e.node("a", 8)
	small := e.node("small", 1)
	vm := e.running("vm", "2Gi")
	if vm.Status.NodeName != a {
		t.Fatalf("the VM went to %s", vm.Status.NodeName)
	}
	// A VM with a claim's volume cannot follow (its emptyDisk volumes could): refused before
	// anything is prepared or paused, naming the claim, whether or not it runs yet.
	claimed := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "claimed"}, Spec: impv1.ImpVMSpec{Image: "registry.test/app:1",
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("1Gi"))}, NodeSelector: map[string]string{"imp.test/pool": e.ns}, Volumes: []impv1.Volume{
			{Name: "scratch", EmptyDisk: &impv1.EmptyDiskSource{Capacity: "64Mi"}},
			{Name: "data", PersistentVolumeClaim: &impv1.PersistentVolumeClaimVolumeSource{ClaimName: "data-claim"}}}}}
	if err := e.c.Create(context.Background(), claimed); err != nil {
		t.Fatal(err)
	}
	e.migrate("claim", "claimed", "", nil)
	if m := e.phase("claim", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonCannotMove || !strings.Contains(m.Status.Message, "data (claim data-claim)") {
		t.Errorf("a migration of a VM with a claim's volume: %s %q", m.Status.Reason, m.Status.Message)
	}
	// Nor can an OS's (spec.boot OS), whether or not it runs yet.
	osVM := &impv1.ImpVM{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "debian"}, Spec: impv1.ImpVMSpec{Image: "registry.test/debian:12", Boot: impv1.BootOS,
		Resources: &impv1.VMResources{VCPUs: ptr.To[int32](1), Memory: ptr.To(resource.MustParse("1Gi"))}, NodeSelector: map[string]string{"imp.test/pool": e.ns}}}
	if err := e.c.Create(context.Background(), osVM); err != nil {
		t.Fatal(err)
	}
	e.migrate("os", "debian", "", nil)
	if m := e.phase("os", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonCannotMove || !strings.Contains(m.Status.Message, "boots an OS") {
		t.Errorf("a migration of an OS's VM: %s %q", m.Status.Reason, m.Status.Message)
	}
	e.migrate("nothing", "novm", "", nil)
	if m := e.phase("nothing", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonVMNotFound {
		t.Errorf("a migration of no VM: %s %q", m.Status.Reason, m.Status.Message)
	}
	e.migrate("here", "vm", a, nil)
	if m := e.phase("here", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonNoTarget {
		t.Errorf("a migration to the VM's own node: %s %q", m.Status.Reason, m.Status.Message)
	}
	e.migrate("tight", "vm", small, ptr.To[int32](10))
	NewWithT(t).Eventually(func() string { return e.migration("tight").Status.Message }).WithTimeout(time.Minute).Should(ContainSubstring("too little free memory"))
	if m := e.phase("tight", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonTimedOut {
		t.Errorf("a migration to a node with no room: %s %q", m.Status.Reason, m.Status.Message)
	}
	// Nodes that could hold it but take no migrations (an agent without the endpoint), boot
	// guests with another kernel, or give them another CPU (KVM's host CPU, not TCG's), or run
	// another version of its VMM, are no target: the migration waits, saying why, and times out.
	old, other := e.nodeWith("old", 8, "", "k1"), e.nodeWith("other", 8, "127.0.0.1:10261", "k2")
	cpu := e.nodeWith("cpu", 8, "127.0.0.1:10261", "k1", func(s *impv1.ImpNodeStatus) {
		s.VMMs = []impv1.VMMCapability{{Kind: impv1.VMMQEMU, Acceleration: "kvm", GuestCPU: "host:0123"}}
	})
	version := e.nodeWith("version", 8, "127.0.0.1:10261", "k1", func(s *impv1.ImpNodeStatus) {
		s.VMMs = []impv1.VMMCapability{{Kind: impv1.VMMQEMU, Acceleration: "tcg", Version: "9.2.0"}}
	})
	for _, target := range []string{old, other, cpu, version} {
		name := "to-" + target[:strings.Index(target, "-"+e.sfx)][4:]
		e.migrate(name, "vm", target, ptr.To[int32](10))
		NewWithT(t).Eventually(func() string { return e.migration(name).Status.Message }).WithTimeout(time.Minute).Should(
			ContainSubstring("takes migrations with the source's kernel and initramfs, and its VMM's version and guest CPU"))
		if m := e.phase(name, impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonTimedOut {
			t.Errorf("a migration to %s: %s %q", target, m.Status.Reason, m.Status.Message)
		}
	}
	// A merge patch: the VM's status moves meanwhile (the last migration letting go of it).
	if err := e.c.Patch(context.Background(), e.vm("vm"), client.RawPatch(types.MergePatchType, []byte(`{"spec":{"runStrategy":"Halted"}}`))); err != nil {
		t.Fatal(err)
	}
	NewWithT(t).Eventually(func() impv1.VMPhase { return e.vm("vm").Status.Phase }).WithTimeout(time.Minute).ShouldNot(Equal(impv1.VMRunning))
	e.migrate("halted", "vm", "", nil)
	if m := e.phase("halted", impv1.MigrationFailed); m.Status.Reason != impvmmigration.ReasonVMNotRunning {
		t.Errorf("a migration of a halted VM: %s %q", m.Status.Reason, m.Status.Message)
	}
	if got := e.vm("vm").Status.Migration; got != nil {
		t.Errorf("a migration that could not start left its name on the VM: %+v", got)
	}
}

// TestOnlyEditorsMigrate: moving a VM is an ImpVMMigration, which the edit role may create and
// the view role may not (the chart's roles): a viewer's migration is refused by the API server.
func TestOnlyEditorsMigrate(t *testing.T) {
	cl := testcluster.Require(t, shared)
	cl.InstallChartObjects(t, "ClusterRole") // the chart's user roles
	ctx := context.Background()
	ns := cl.Namespace(t)
	as := func(user, role, verb string) client.Client {
		t.Helper()
		rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: user + "-" + role},
			RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}}}
		if err := cl.Client.Create(ctx, rb); err != nil {
			t.Fatal(err)
		}
		// The binding is in force once the authorizer grants verb, which role grants.
		NewWithT(t).Eventually(func() bool {
			sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user,
				ResourceAttributes: &authorizationv1.ResourceAttributes{Namespace: ns, Verb: verb, Group: impv1.GroupVersion.Group, Resource: "impvmmigrations"}}}
			return cl.Client.Create(ctx, sar) == nil && sar.Status.Allowed
		}).WithTimeout(30*time.Second).WithPolling(50*time.Millisecond).Should(BeTrue(), user+"'s binding never took effect")
		cfg := rest.CopyConfig(cl.Config)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user}
		c, err := client.New(cfg, client.Options{Scheme: cl.Scheme})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	mig := func() *impv1.ImpVMMigration {
		return &impv1.ImpVMMigration{ObjectMeta: metav1.ObjectMeta{Namespace: ns, GenerateName: "m-"}, Spec: impv1.ImpVMMigrationSpec{VMName: "vm"}}
	}
	if err := as("vera", "imp-view", "get").Create(ctx, mig()); !apierrors.IsForbidden(err) {
		t.Errorf("a viewer's migration: %v; want Forbidden", err)
	}
	if err := as("eddie", "imp-edit", "create").Create(ctx, mig()); err != nil {
		t.Errorf("an editor's migration: %v", err)
	}
}

// gathered is the operator's migration metrics as this process's registry has them, by
// name{labels} (a histogram's _count and _sum).
func gathered(t *testing.T) map[string]float64 {
	t.Helper()
	families, err := crmetrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range families {
		if !strings.HasPrefix(f.GetName(), "imp_vm_migration") {
			continue
		}
		for _, m := range f.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			suffix := ""
			if len(labels) > 0 {
				suffix = "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.GetCounter() != nil:
				out[f.GetName()+suffix] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				out[f.GetName()+"_count"+suffix] = float64(m.GetHistogram().GetSampleCount())
				out[f.GetName()+"_sum"+suffix] = m.GetHistogram().GetSampleSum()
			}
		}
	}
	return out
}

// TestMigrationsOfANamespaceWaitTheirTurn: with one migration of a namespace under way at once,
// a second waits Pending, saying why (Queued), and holds neither its VM nor room; it begins once
// the first ended.
func TestMigrationsOfANamespaceWaitTheirTurn(t *testing.T) {
	e := newEnvWith(t, func(o *operator.Options) { o.MigrationsPerNamespace = 1 })
	e.node("a", 8)
	e.node("b", 8)
	e.running("one", "1Gi")
	e.running("two", "1Gi")
	first := e.migrate("first", "one", "", nil)
	e.phase("first", impv1.MigrationPreparing)
	e.migrate("second", "two", "", nil)
	NewWithT(t).Eventually(func() string {
		m := e.migration("second")
		for _, c := range m.Status.Conditions {
			if c.Type == impv1.ReadyCondition && m.Status.Phase == impv1.MigrationPending {
				return c.Reason + ": " + c.Message
			}
		}
		return string(m.Status.Phase)
	}).WithTimeout(time.Minute).Should(And(HavePrefix(impvmmigration.ReasonQueued+": "), ContainSubstring("under way: 1 (first)")))
	if m := e.vm("two").Status.Migration; m != nil {
		t.Errorf("a queued migration holds its VM: %+v", m)
	}
	if err := e.c.Delete(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	e.phase("second", impv1.MigrationPreparing)
}

// TestAnOperatorKilledAtTheCommit: the operator runs as a process and is killed (at a failpoint:
// it exits at once, as kill -9 would leave it) just after the commit's write, the VM's node
// moved to the target, before the migration is told. The operator that returns finds the commit
// on the VM, records it, and the migration succeeds once the target runs the VM: no second
// commit, no failure, the VM on its target.
func TestAnOperatorKilledAtTheCommit(t *testing.T) {
	e := newEnvNoOperator(t)
	exited := e.startOperatorProcess(failpoint.EnvVar + "=migration-committed")
	e.node("a", 8)
	e.node("b", 8)
	vm := e.running("vm", "1Gi")
	source := vm.Status.NodeName
	e.migrate("move", "vm", "", nil)
	m := e.phase("move", impv1.MigrationPreparing)
	target := m.Status.TargetNode
	src, tgt := e.agent(source), e.agent(target)
	say := func(a client.Client, side string, r impv1.MigrationAgentReport) {
		t.Helper()
		NewWithT(t).Eventually(func() error { return e.report(a, "move", side, r) }).WithTimeout(time.Minute).Should(Succeed())
	}
	say(tgt, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentReady})
	e.phase("move", impv1.MigrationTransferring)
	say(tgt, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentLoaded, Bytes: 64 << 20})
	say(src, "source", impv1.MigrationAgentReport{State: impv1.MigrationAgentPaused, Bytes: 64 << 20, Downtime: &metav1.Duration{Duration: 30 * time.Millisecond}})
	select {
	case code := <-exited:
		if code != failpoint.ExitCode {
			t.Fatalf("the operator ended with %d, not at its failpoint", code)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the operator never reached its failpoint")
	}
	if got, m := e.vm("vm"), e.migration("move"); got.Status.NodeName != target || m.Status.Phase != impv1.MigrationTransferring {
		t.Fatalf("at the failpoint: the VM on %s, the migration %s; want the VM on %s, the migration not yet told", got.Status.NodeName, m.Status.Phase, target)
	}

	e.startOperatorProcess()
	m = e.phase("move", impv1.MigrationCommitted)
	if m.Status.CommittedAt == nil || m.Status.Downtime == nil || m.Status.Downtime.Duration != 30*time.Millisecond {
		t.Errorf("the commit recorded: %+v", m.Status)
	}
	say(tgt, "target", impv1.MigrationAgentReport{State: impv1.MigrationAgentRunning, Bytes: 64 << 20})
	e.phase("move", impv1.MigrationSucceeded)
	NewWithT(t).Eventually(func() *impv1.MigrationStatus { return e.vm("vm").Status.Migration }).WithTimeout(time.Minute).Should(BeNil())
	if got := e.vm("vm"); got.Status.NodeName != target || got.Status.Instance != vm.Status.Instance || got.Status.Phase != impv1.VMRunning {
		t.Errorf("after the migration: the VM %s on %s, instance %d; want running on %s, instance %d", got.Status.Phase, got.Status.NodeName, got.Status.Instance, target, vm.Status.Instance)
	}
}
