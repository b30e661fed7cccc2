package impvm_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
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
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	impv1 "github.com/syscode-labs/imp/api/v1alpha1"
	"github.com/syscode-labs/imp/internal/agent/volume"
	"github.com/syscode-labs/imp/internal/controller/impvm"
	"github.com/syscode-labs/imp/internal/operator"
	"github.com/syscode-labs/imp/internal/testcluster"
)

var shared *testcluster.Cluster

func TestMain(m *testing.M) { os.Exit(testcluster.Main(m, &shared)) }

const gi = int64(1) << 30

// env is one test's world: its namespace, a label only its nodes carry (so that VMs of other
// tests never land on them), and the operator it runs.
type env struct {
	t    *testing.T
	c    client.Client
	cl   *testcluster.Cluster
	ns   string
	pool string
	opts operator.Options
	// holdMembers: the agent double starts no warm pool member while set.
	holdMembers atomic.Bool
	// failHandover: the agent double fails every handover of a member to a claim.
	failHandover atomic.Bool
}

func newEnv(t *testing.T) *env {
	c := testcluster.Require(t, shared)
	ns := c.Namespace(t)
	opts := operator.Options{VM: impvm.DefaultOptions(), Concurrency: 4}
	opts.VM.RestartBackoffBase = 200 * time.Millisecond
	opts.VM.RestartBackoffMax = time.Second
	opts.VM.NodeLostGracePeriod = 2 * time.Second
	opts.VM.AgentHeartbeatTimeout = time.Hour // the simulated reports beat only where a test says
	opts.VM.DeletionTimeout = 30 * time.Second
	opts.VolumeHolderImage = "registry.test/imp-operator:test"
	return &env{t: t, c: c.Client, cl: c, ns: ns, pool: ns, opts: opts}
}

// startOperator runs the operator in-process until the returned function (also a test cleanup)
// stops it.
func (e *env) startOperator() (stop func()) {
	e.t.Helper()
	mgr, err := ctrl.NewManager(e.cl.As(e.t, testcluster.Operator), ctrl.Options{
		Scheme:                 e.cl.Scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
		Controller:             config.Controller{SkipNameValidation: ptr.To(true)},
		Cache:                  operator.CacheOptions(e.opts),
	})
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	if err := operator.Setup(ctx, mgr, e.opts); err != nil {
		e.t.Fatal(err)
	}
	return testcluster.RunManager(e.t, mgr)
}

type nodeOpt func(*corev1.Node)

// node creates a Ready node of the test's pool with an agent report of vcpus and memGi.
func (e *env) node(name string, vcpus int32, memGi int64, opts ...nodeOpt) *corev1.Node {
	e.t.Helper()
	ctx := context.Background()
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: e.ns + "-" + name, Labels: map[string]string{
		impv1.NodeEnabledLabel: "true", "imp.test/pool": e.pool,
	}}}
	for _, o := range opts {
		o(n)
	}
	st := n.Status
	if err := e.c.Create(ctx, n); err != nil {
		e.t.Fatal(err)
	}
	n.Status = st
	hasReady := false
	for _, c := range n.Status.Conditions {
		hasReady = hasReady || c.Type == corev1.NodeReady
	}
	if !hasReady {
		n.Status.Conditions = append(n.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastTransitionTime: metav1.Now()})
	}
	if err := e.c.Status().Update(ctx, n); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.c.Delete(context.Background(), n) })

	rep := &impv1.ImpNode{ObjectMeta: metav1.ObjectMeta{Name: n.Name}}
	if err := e.c.Create(ctx, rep); err != nil {
		e.t.Fatal(err)
	}
	rep.Status = impv1.ImpNodeStatus{
		Allocatable: &impv1.NodeResources{VCPUs: vcpus, Memory: *resource.NewQuantity(memGi*gi, resource.BinarySI)},
		VMMs:        []impv1.VMMCapability{{Kind: impv1.VMMQEMU, Acceleration: "tcg"}},
		Conditions:  []metav1.Condition{{Type: impv1.ReadyCondition, Status: metav1.ConditionTrue, Reason: impv1.ReasonAgentReady, LastTransitionTime: metav1.Now()}},
	}
	if err := e.c.Status().Update(ctx, rep); err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = e.c.Delete(context.Background(), rep) })
	return n
}

func withCondition(t corev1.NodeConditionType, s corev1.ConditionStatus) nodeOpt {
	return func(n *corev1.Node) {
		n.Status.Conditions = append(n.Status.Conditions, corev1.NodeCondition{Type: t, Status: s, LastTransitionTime: metav1.Now()})
	}
}

// vm returns (does not create) a VM of the test's pool.
func (e *env) vm(name string, vcpus int32, mem string) *impv1.ImpVM {
	return &impv1.ImpVM{
		ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name},
		Spec: impv1.ImpVMSpec{
			Image:        "registry.test/app:1",
			Resources:    &impv1.VMResources{VCPUs: ptr.To(vcpus), Memory: ptr.To(resource.MustParse(mem))},
			NodeSelector: map[string]string{"imp.test/pool": e.pool},
		},
	}
}

// tenant binds the user "tenant" to role (a ClusterRole, or a Role of the test's namespace)
// there and returns a client acting as that user.
func (e *env) tenant(kind, role string) client.Client {
	e.t.Helper()
	e.create(&rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "tenant-" + role},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: kind, Name: role},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: "tenant"}}})
	cfg := rest.CopyConfig(e.cl.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: "tenant", Groups: []string{"system:authenticated"}}
	c, err := client.New(cfg, client.Options{Scheme: e.cl.Scheme})
	if err != nil {
		e.t.Fatal(err)
	}
	return c
}

func (e *env) create(objs ...client.Object) {
	e.t.Helper()
	for _, o := range objs {
		if err := e.c.Create(context.Background(), o); err != nil {
			e.t.Fatalf("creating %s: %v", o.GetName(), err)
		}
	}
}

func (e *env) get(name string) *impv1.ImpVM {
	vm := &impv1.ImpVM{}
	if err := e.c.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, vm); err != nil {
		return nil
	}
	return vm
}

func (e *env) list() []impv1.ImpVM {
	var l impv1.ImpVMList
	if err := e.c.List(context.Background(), &l, client.InNamespace(e.ns)); err != nil {
		e.t.Errorf("listing VMs: %v", err)
	}
	return l.Items
}

func condition(vm *impv1.ImpVM, t string) *metav1.Condition {
	if vm == nil {
		return nil
	}
	for i := range vm.Status.Conditions {
		if vm.Status.Conditions[i].Type == t {
			return &vm.Status.Conditions[i]
		}
	}
	return nil
}

// scheduled returns "True", a False condition's reason, or "" when the operator has not
// decided yet.
func scheduled(vm *impv1.ImpVM) string {
	c := condition(vm, impv1.ScheduledCondition)
	switch {
	case c == nil:
		return ""
	case c.Status == metav1.ConditionTrue:
		return "True"
	}
	return c.Reason
}

// events returns the reasons of the Events about VMs in the test's namespace.
func (e *env) events() map[string]int {
	var l corev1.EventList
	if err := e.c.List(context.Background(), &l, client.InNamespace(e.ns)); err != nil {
		e.t.Errorf("listing events: %v", err)
	}
	out := map[string]int{}
	for _, ev := range l.Items {
		out[ev.Reason]++
	}
	return out
}

// agent is a test double for the node agents of the test's nodes: it reports every VM placed
// on them as running (or as exit tells), stopped when halted, and gone when deleted, by
// merge-patching status.runtime alone, as the real agent does.
type agent struct {
	e *env
	// exit, when set, returns the exit code a run of vm reports once running, or nil to keep
	// it running.
	exit func(vm *impv1.ImpVM) *int32
	// seen is each VM placed on the test's nodes, by name, as the double last saw it.
	seen sync.Map
}

// started is the VM name as the double last saw it placed.
func (a *agent) started(name string) (*impv1.ImpVM, bool) {
	v, ok := a.seen.Load(name)
	if !ok {
		return &impv1.ImpVM{}, false
	}
	return v.(*impv1.ImpVM), true
}

func (e *env) startAgent(exit func(vm *impv1.ImpVM) *int32) *agent {
	a := &agent{e: e, exit: exit}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				for _, vm := range e.list() {
					a.observe(ctx, &vm)
				}
				a.snapshots(ctx)
			}
		}
	}()
	e.t.Cleanup(func() { cancel(); <-done })
	return a
}

// snapshots takes the snapshots given to the test's nodes at once (Ready, pushed when they
// have a registry), and removes the files of deleted ones.
func (a *agent) snapshots(ctx context.Context) {
	var l impv1.ImpVMSnapshotList
	if err := a.e.c.List(ctx, &l, client.InNamespace(a.e.ns)); err != nil {
		return
	}
	for i := range l.Items {
		snap := &l.Items[i]
		st := &snap.Status
		switch {
		case st.NodeName == "" || st.FilesRemoved:
			continue
		case !snap.DeletionTimestamp.IsZero():
			st.FilesRemoved = true
		case st.Phase == impv1.SnapshotPending:
			vm := a.e.get(snap.Spec.VMName)
			if vm == nil || vm.Status.Resources == nil {
				continue
			}
			res := vm.Status.Resources
			st.Phase = impv1.SnapshotReady
			st.Source = &impv1.SnapshotSource{VMUID: vm.UID, Image: "registry.test/app@sha256:" + strings.Repeat("0", 64), VMM: impv1.VMMQEMU,
				VCPUs: res.VCPUs, Memory: res.Memory, DiskSize: res.DiskSize, Network: vm.Spec.NetworkRef != nil}
			if snap.Spec.Registry != nil {
				st.Digest = "sha256:" + strings.Repeat("1", 64)
			}
		default:
			continue
		}
		if err := a.e.c.Status().Update(ctx, snap); err != nil && ctx.Err() == nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			a.e.t.Logf("agent double: reporting snapshot %s: %v", snap.Name, err)
		}
	}
}

func (a *agent) observe(ctx context.Context, vm *impv1.ImpVM) {
	st := vm.Status
	if st.NodeName == "" || st.Instance == 0 {
		return
	}
	a.seen.Store(vm.Name, vm.DeepCopy())
	rt := st.Runtime
	current := rt != nil && rt.Instance == st.Instance && rt.Run == st.RestartCount
	now := metav1.Now()
	next := impv1.RuntimeStatus{Instance: st.Instance, Run: st.RestartCount}
	switch {
	case !vm.DeletionTimestamp.IsZero():
		if current && rt.State == impv1.RuntimeGone {
			return
		}
		next.State = impv1.RuntimeGone
	case vm.Spec.RunStrategy == impv1.RunStrategyHalted:
		if current && rt.State == impv1.RuntimeStopped {
			return
		}
		next.State, next.FinishedAt = impv1.RuntimeStopped, &now
	case st.Phase == impv1.VMSucceeded || st.Phase == impv1.VMFailed:
		return
	case !current:
		next.State, next.StartedAt, next.GuestReady = impv1.RuntimeRunning, &now, true
		if st.RestartCount == 0 {
			next.RestoredFrom = vm.RestoreFrom()
		}
		switch {
		case st.Warm != nil && a.e.failHandover.Load():
			next.State, next.StartedAt, next.GuestReady = impv1.RuntimeExited, nil, false
			next.FinishedAt, next.Reason, next.Message = &now, impv1.ReasonWarmHandoverFailed, "the member's guest did not take on the claim's identity"
			next.RestoredFrom = ""
		case st.Warm != nil:
			next.RestoredFrom = "" // a claim handed a member: the member's guest, now the claim's
		case vm.IsCopy() && next.RestoredFrom == "":
			return // a copy waits for its template's snapshot, as the agent does
		case impv1.WarmPoolOf(vm) != "" && a.e.holdMembers.Load():
			return
		}
		if !volume.HolderReady(vm) {
			return // its claims are not held on its node yet, as the agent waits
		}
	case st.Suspension != nil && rt.State == impv1.RuntimeRunning:
		next = *rt
		next.State, next.GuestReady, next.Message = impv1.RuntimeSuspended, false, "memory saved"
	case st.Suspension == nil && rt.State == impv1.RuntimeSuspended:
		next = *rt
		next.State, next.GuestReady, next.Message = impv1.RuntimeRunning, true, impv1.RuntimeResumedMessage
		next.IdleSince, next.WakeRequested = nil, nil // as the agent's resumed run: active again
	case rt.State == impv1.RuntimeRunning && a.exit != nil:
		code := a.exit(vm)
		if code == nil {
			return
		}
		next = *rt
		next.State, next.FinishedAt, next.ExitCode, next.Reason = impv1.RuntimeExited, &now, code, "WorkloadExited"
	default:
		return
	}
	patch, _ := json.Marshal(map[string]any{"status": map[string]any{"runtime": next}})
	err := a.e.c.Status().Patch(ctx, vm, client.RawPatch(types.MergePatchType, patch))
	if err != nil && !apierrors.IsNotFound(err) && ctx.Err() == nil {
		a.e.t.Logf("agent double: reporting %s: %v", vm.Name, err)
	}
}

// eventually is Gomega's Eventually with the suite's defaults.
func eventually(t *testing.T, f any, args ...any) AsyncAssertion {
	return NewWithT(t).Eventually(f, args...).WithTimeout(60 * time.Second).WithPolling(50 * time.Millisecond)
}

func name(prefix string, i int) string { return fmt.Sprintf("%s-%03d", prefix, i) }

// consistently is Gomega's Consistently for d.
func consistently(t *testing.T, f any, d time.Duration) AsyncAssertion {
	return NewWithT(t).Consistently(f).WithTimeout(d).WithPolling(100 * time.Millisecond)
}

// startOperatorProcess runs the imp-operator binary, as the chart's operator identity, until
// the returned function kills it (SIGKILL: a crash, not a shutdown) or the test ends.
func (e *env) startOperatorProcess() (kill func()) {
	e.t.Helper()
	kill, _ = e.startOperatorProcessWith()
	return kill
}

// startOperatorProcessWith is startOperatorProcess with env added to the process's
// environment (a failpoint); exited is closed when the process has ended.
func (e *env) startOperatorProcessWith(env ...string) (kill func(), exited <-chan struct{}) {
	e.t.Helper()
	cmd := exec.Command(testcluster.Binary(e.t, "github.com/syscode-labs/imp/cmd/imp-operator"), "--kubeconfig", e.cl.KubeconfigAs(e.t, testcluster.Operator), "--leader-elect=false",
		"--metrics-bind-address", "0", "--health-probe-bind-address", "0", "--log-level", "error",
		"--restart-backoff-base", e.opts.VM.RestartBackoffBase.String(), "--restart-backoff-max", e.opts.VM.RestartBackoffMax.String(),
		"--node-lost-grace-period", e.opts.VM.NodeLostGracePeriod.String(), "--agent-heartbeat-timeout", e.opts.VM.AgentHeartbeatTimeout.String(),
		"--deletion-timeout", e.opts.VM.DeletionTimeout.String())
	cmd.Stderr = os.Stderr
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	kill = func() { _ = cmd.Process.Kill(); <-done }
	e.t.Cleanup(kill)
	return kill, done
}
